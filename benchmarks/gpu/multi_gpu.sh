#!/bin/bash
# Multi-GPU evidence (issues 20 and 15) in one lease of a machine of N GPUs, from the repository root:
#   bash benchmarks/gpu/multi_gpu.sh part        # each call that carries one .te/pK part of the TE core wheel
#   bash benchmarks/gpu/multi_gpu.sh all         # the call that carries the last part, .whl and .whl2
#   bash benchmarks/gpu/multi_gpu.sh more        # a later call on the same warm machine: what `all` left
# `all` (MULTI_BUDGET_S seconds, default 560, of which the last ~130 are kept for the one-GPU rows):
#   1. run_all.sh part (the last part) and setup; Transformer Engine built in the background on all but 4 CPU cores, while the
#      NCCL probe (benchmarks/nccl_probe.py, all GPUs) and the env stage (per-GPU matmul) run on those 4;
#   2. the 'multi' rows of benchmarks/gpu/specs_multi.jsonl (configs_multi.py) on all N GPUs, in order,
#      until the deadline (runner.py);
#   3. the 'multi_fake' (--fake-process-group) row of every plan that ran in 2, on GPU 0, while the MoE
#      kernel probes (benchmarks/kernel_probe.py moe) run on GPU 1.
# Everything comes back in at most 8 files under $OUT (the device tool's limit). Rerun the whole set
# with the same calls; merge here with benchmarks/gpu/report_multi.py.
# NVLink multicast stays off (KINDS.md), TE's userbuffers included (UB_SKIPMC: tp_comm_overlap would
# otherwise call cuMulticastCreate on Hopper).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 UB_SKIPMC=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=benchmarks/gpu
T0=$(date +%s)
BUDGET=${MULTI_BUDGET_S:-560}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
stamp() { echo "[multi_gpu +$(( $(date +%s) - T0 ))s] $*"; }

run_all() {  # run_all.sh stages writing their logs into $OUT/misc
  OUT="$OUT/misc" bash $HERE/run_all.sh "$@"
}

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
  echo "$ngpu" > /tmp/ngpu
}

real_rows() {
  local ngpu deadline
  ngpu=$(cat /tmp/ngpu)
  deadline=$(( $(left) - 130 ))
  stamp "real rows until +${deadline}s from now"
  python3 $HERE/runner.py --out "$OUT/real" --specs $HERE/specs_multi.jsonl --groups multi --gpus "$ngpu" \
    --deadline-s "$deadline" --run-timeout-s 90 --work /tmp/multi_runs \
    --traces tp2_sp,moe8top2_ep2_alltoall,dp2_distopt_overlap,tp4_sp,moe8top2_ep4_alltoall,dp4_distopt_overlap
}

fake_rows_and_kernels() {
  local names
  names=$(python3 -c "import json,sys; print(','.join('fake_'+json.loads(l)['name'] for l in open(sys.argv[1]) if l.strip()))" \
          "$OUT/real/results.jsonl" 2>/dev/null)
  names=$(python3 -c "import json,sys; have={json.loads(l)['name'] for l in open(sys.argv[1])}; print(','.join(n for n in sys.argv[2].split(',') if n in have))" \
          $HERE/specs_multi.jsonl "$names")
  stamp "fake rows: $names; MoE kernel probes on GPU 1"
  (CUDA_VISIBLE_DEVICES=1 OUT="$OUT" timeout $(( $(left) - 10 )) python3 benchmarks/kernel_probe.py moe \
     > "$OUT/misc/kernel_probe.log" 2>&1; echo "kernel probe rc=$?" >> "$OUT/misc/kernel_probe.log") &
  local kp=$!
  [ -n "$names" ] && python3 $HERE/runner.py --out "$OUT/misc/fake" --specs $HERE/specs_multi.jsonl --names "$names" \
    --gpus 1 --deadline-s $(( $(left) - 45 )) --run-timeout-s 60 --work /tmp/multi_fake
  cp "$OUT/misc/fake/results.jsonl" "$OUT/fake_results.jsonl" 2>/dev/null
  wait $kp
  tail -2 "$OUT/misc/kernel_probe.log"
}

more_rows() {  # a later call on the same warm machine: the rows (and fake rows) not run yet
  local todo fakes
  todo=$(python3 -c "import json,os,sys; done=set(os.listdir('/tmp/multi_runs')) if os.path.isdir('/tmp/multi_runs') else set(); print(','.join(r['name'] for r in map(json.loads, open(sys.argv[1])) if r['group']=='multi' and r['name'] not in done))" $HERE/specs_multi.jsonl)
  stamp "rows not run yet: $todo"
  [ -n "$todo" ] && python3 $HERE/runner.py --out "$OUT/real" --specs $HERE/specs_multi.jsonl --names "$todo" \
    --gpus "$(nvidia-smi -L | wc -l)" --deadline-s $(( $(left) - 100 )) --run-timeout-s 90 --work /tmp/multi_runs
  fakes=$(python3 -c "import json,os,sys; ran=set(os.listdir('/tmp/multi_runs')); done=set(os.listdir('/tmp/multi_fake')) if os.path.isdir('/tmp/multi_fake') else set(); print(','.join(r['name'] for r in map(json.loads, open(sys.argv[1])) if r['group']=='multi_fake' and r['name'][5:] in ran and r['name'] not in done))" $HERE/specs_multi.jsonl)
  stamp "fake rows: $fakes"
  [ -n "$fakes" ] && python3 $HERE/runner.py --out "$OUT/misc/fake" --specs $HERE/specs_multi.jsonl --names "$fakes" \
    --gpus 2 --deadline-s $(( $(left) - 45 )) --run-timeout-s 60 --work /tmp/multi_fake
  cp "$OUT/misc/fake/results.jsonl" "$OUT/fake_results.jsonl" 2>/dev/null
}

case ${1:-} in
  more)
    mkdir -p "$OUT/misc"
    more_rows
    tar czf "$OUT/misc.tar.gz" -C "$OUT" misc && rm -rf "$OUT/misc"
    stamp "done" ;;
  part) bash $HERE/run_all.sh part ;;
  all)
    mkdir -p "$OUT/misc"
    bash $HERE/run_all.sh part  # the last part travels with this call (a first lease missed it: md5 mismatch, no TE)
    run_all setup
    probes_during_build
    real_rows
    fake_rows_and_kernels
    tar czf "$OUT/misc.tar.gz" -C "$OUT" misc && rm -rf "$OUT/misc"
    stamp "done; files: $(cd "$OUT" && find . -type f | tr '\n' ' ')" ;;
  *) echo "usage: multi_gpu.sh part|all"; exit 2 ;;
esac
