#!/bin/bash
# Multi-GPU evidence (issues 20, 14 and 15) in one lease of a machine of N GPUs, from the repository root:
#   bash benchmarks/gpu/multi_gpu.sh part     # each call that carries one .te/pK part of the TE core wheel (9 of 30 MiB)
#   bash benchmarks/gpu/multi_gpu.sh stash    # a call that carries .whl or .whl2 alone: kept in /tmp/stash for `all`
#   bash benchmarks/gpu/multi_gpu.sh all      # the call after the parts (and stashes): carries .whl, .whl2 unless stashed
#   bash benchmarks/gpu/multi_gpu.sh more     # later calls on the same warm machine: the rows not run yet
#   bash benchmarks/gpu/multi_gpu.sh kernels  # the MoE kernel probes (benchmarks/kernel_probe.py moe), GPU 0
# `all` (MULTI_BUDGET_S seconds, default 570):
#   1. run_all.sh part (the last part) and setup; Transformer Engine built in the background on all but 4
#      CPU cores while the NCCL probe (benchmarks/nccl_probe.py, all GPUs) and the env stage (per-GPU
#      matmul) run on those 4;
#   2. the rows of benchmarks/gpu/specs_multi.jsonl (configs_multi.py) in file order until the deadline
#      (runner.py --share-multi: 2-GPU rows run two at a time and one-GPU rows four at a time, each row
#      recording what ran beside it).
# Before the lease: `git describe --always --dirty --abbrev=40 > benchmarks/gpu/git_state.txt` and carry that file with
# `all` (git ignores it, so a stale copy never travels; runner.py records "unknown" without it).
# `more` runs the rows that no earlier call of this lease started. Everything comes back in a few files
# under $OUT; merge here with benchmarks/gpu/report_multi.py.
# NVLink multicast stays off (KINDS.md), TE's userbuffers included (UB_SKIPMC: tp_comm_overlap would
# otherwise call cuMulticastCreate on Hopper).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/misc"
HERE=benchmarks/gpu
SPECS=${SPECS:-$HERE/specs_multi.jsonl}  # SPECS=benchmarks/gpu/specs_multi_L.jsonl: the second set (configs_multi.py --set large)
T0=$(date +%s)
BUDGET=${MULTI_BUDGET_S:-570}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
stamp() { echo "[multi_gpu +$(( $(date +%s) - T0 ))s] $*"; }

probes_during_build() {
  local ncpu ngpu spare
  ncpu=$(nproc); ngpu=$(nvidia-smi -L | wc -l); spare="$((ncpu - 4))-$((ncpu - 1))"
  (taskset -c 0-$((ncpu - 5)) bash -c "OUT=$OUT/misc bash $HERE/run_all.sh te" > "$OUT/misc/te_stage.log" 2>&1) &
  local te_pid=$!
  stamp "TE build started (pid $te_pid) on cores 0-$((ncpu - 5)); NCCL probe on $ngpu GPUs, cores $spare"
  OUT="$OUT" timeout 120 taskset -c "$spare" python3 -m torch.distributed.run --nproc_per_node "$ngpu" \
    benchmarks/nccl_probe.py > "$OUT/misc/nccl_probe.log" 2>&1
  stamp "nccl probe rc=$?"
  taskset -c "$spare" bash -c "OUT=$OUT bash $HERE/run_all.sh env" > "$OUT/misc/env_stage.log" 2>&1
  stamp "env done; waiting for TE"
  wait $te_pid
  tail -4 "$OUT/misc/te_stage.log"
}

rows() {  # every row of $SPECS that no call of this lease started yet, in file order
  local todo
  todo=$(python3 -c "import json,os,sys; done=set(os.listdir('/tmp/multi_runs')) if os.path.isdir('/tmp/multi_runs') else set(); print(','.join(r['name'] for r in map(json.loads, open(sys.argv[1])) if r['name'] not in done))" $SPECS)
  stamp "rows to run: $todo"
  [ -n "$todo" ] && python3 $HERE/runner.py --out "$OUT/real" --specs $SPECS --names "$todo" --share-multi --solo "${SOLO:-}" \
    --gpus "$(nvidia-smi -L | wc -l)" --deadline-s $(( $(left) - ${RUN_TIMEOUT_S:-90} - 12 )) --run-timeout-s ${RUN_TIMEOUT_S:-90} --work /tmp/multi_runs \
    --traces ${TRACES:-tp4_sp,tp4_sp_tpoverlap,moe8top2_ep4_alltoall,moe64top8_ep4_alltoall,dp4_distopt_overlap,pp4_vp2,cp4_s16k}
}

pack() { tar czf "$OUT/misc.tar.gz" -C "$OUT" misc && rm -rf "$OUT/misc"; stamp "done; files: $(cd "$OUT" && find . -type f | tr '\n' ' ')"; }

# The working tree and the carried paths travel within 64 MiB per call: once the tracked tree outgrew a TE part plus
# both wheel folders, each of .whl and .whl2 travels in a call of its own and waits in /tmp/stash (a warm machine keeps /tmp).
unstash() { for d in .whl .whl2; do [ ! -d "$d" ] && [ -d "/tmp/stash/$d" ] && cp -r "/tmp/stash/$d" .; done; ls -d .whl .whl2 2>&1; }

case ${1:-} in
  part) bash $HERE/run_all.sh part ;;
  stash) mkdir -p /tmp/stash; for d in .whl .whl2; do [ -d "$d" ] && cp -r "$d" /tmp/stash/; done; ls /tmp/stash ;;
  all)
    unstash
    bash $HERE/run_all.sh part  # the last part travels with this call
    OUT="$OUT/misc" bash $HERE/run_all.sh setup
    probes_during_build
    rows
    pack ;;
  more) rows; pack ;;
  kernels)
    CUDA_VISIBLE_DEVICES=0 OUT="$OUT" timeout $(( $(left) - 20 )) python3 benchmarks/kernel_probe.py moe \
      > "$OUT/misc/kernel_probe.log" 2>&1; echo "kernel probe rc=$?" >> "$OUT/misc/kernel_probe.log"
    tail -3 "$OUT/misc/kernel_probe.log"; pack ;;
  *) echo "usage: multi_gpu.sh part|stash|all|more|kernels"; exit 2 ;;
esac
