#!/bin/bash
# GPU evidence driver, run on the device machine from the repository root:
#   bash benchmarks/gpu/run_all.sh STAGE [STAGE ...] [-- runner args]
# Stages (each writes under $OUT):
#   setup      install the carried wheels (.whl/*.whl, Transformer Engine's kept aside) into /tmp/site
#   part       copy the carried Transformer Engine wheel part(s) (.te/p*/) to /tmp/te/
#   te         install .whl2/*.whl (cuDNN frontend, carried with the last part), reassemble the TE core
#              wheel (md5 check), install it, build transformer_engine_torch
#              (TE-on-gpu.md step 3), check `import transformer_engine.pytorch`
#   env        device list, versions and the bf16 8192^3 matmul rate -> $OUT/env.json
#   args       Megatron-LM argument check of the rendered launch arguments -> $OUT/megatron_args_check.txt
#   runs       benchmarks/gpu/runner.py with the arguments after `--`
# NVLink multicast stays off (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/site /tmp/te /tmp/tewhl
TE_WHEEL=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
TE_MD5=3561d500b47357c6942d006bb1c185f3
stages=(); runner_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; runner_args=("$@"); break; fi
  stages+=("$1"); shift
done
t0=$(date +%s)
stamp() { echo "[run_all +$(( $(date +%s) - t0 ))s] $*"; }

for st in "${stages[@]}"; do
  case $st in
  setup)
    stamp setup
    cp .whl/transformer_engine-*.whl .whl/*.tar.gz /tmp/tewhl/ 2>/dev/null
    ls .whl/*.whl | grep -v '/transformer_engine-' > /tmp/wheels.txt
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(cat /tmp/wheels.txt) > "$OUT/setup.log" 2>&1
    echo "pip rc=$?" >> "$OUT/setup.log"; ls /tmp/site >> "$OUT/setup.log"
    python3 -c "import megatron.core, pydantic; print('megatron-core', megatron.core.__version__ if hasattr(megatron.core,'__version__') else '?', 'pydantic', pydantic.__version__)" >> "$OUT/setup.log" 2>&1
    tail -3 "$OUT/setup.log" ;;
  part)
    stamp part; for p in .te/p*/* .te3/p*/* .te4/p*/*; do [ -f "$p" ] && cp "$p" /tmp/te/; done; ls -la /tmp/te ;;
  te)
    stamp te
    cat /tmp/te/part0* > /tmp/te/$TE_WHEEL || exit 3
    sum=$(md5sum /tmp/te/$TE_WHEEL | cut -d' ' -f1); echo "md5 $sum"
    [ "$sum" = "$TE_MD5" ] || { echo "TE wheel md5 mismatch"; exit 3; }
    rm -f /tmp/te/part0*
    # the build's cuDNN frontend headers travel with the last part (.whl2)
    [ -d .whl2 ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl2/*.whl
    { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/te/$TE_WHEEL /tmp/tewhl/transformer_engine-*.whl
      echo "core install rc=$?"
      rm -rf /tmp/tebuild && mkdir -p /tmp/tebuild && tar xzf /tmp/tewhl/transformer_engine_torch-2.20.2.tar.gz -C /tmp/tebuild
      cd /tmp/tebuild/transformer_engine_torch-2.20.2 || exit 4
      CUDNN_PATH=$(python3 -c 'import nvidia.cudnn as m; print(list(m.__path__)[0])') \
      NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 MAX_JOBS=$(nproc) \
        python3 -m pip install --no-build-isolation --no-deps --no-index --target /tmp/site2 . 2>&1 | tail -25
      echo "build rc=${PIPESTATUS[0]}"
      cp -r /tmp/site2/* /tmp/site/
      cd - > /dev/null
      python3 -c "import transformer_engine, transformer_engine.pytorch; print('TE import OK', transformer_engine.__version__)" 2>&1 | tail -5
    } > "$OUT/te_build.log" 2>&1
    tail -8 "$OUT/te_build.log" ;;
  env)
    stamp env
    { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv; } > /tmp/smi.txt 2>&1
    python3 benchmarks/gpu/matmul.py > /tmp/matmul.json 2>/tmp/matmul.err
    python3 - "$OUT/env.json" <<'PY'
import json, subprocess, sys
def ver(mod):
    try:
        m = __import__(mod); return getattr(m, "__version__", "?")
    except Exception as e:
        return f"not importable: {type(e).__name__}"
env = {"nvidia_smi": open("/tmp/smi.txt").read(), "uname": subprocess.run(["uname", "-r"], capture_output=True, text=True).stdout.strip(),
       "megatron_core": ver("megatron.core.package_info"), "transformer_engine": ver("transformer_engine"), "pydantic": ver("pydantic")}
try:
    env.update(json.load(open("/tmp/matmul.json")))
except Exception as e:
    env["matmul_error"] = open("/tmp/matmul.err").read()[-2000:]
json.dump(env, open(sys.argv[1], "w"), indent=1); print(json.dumps(env)[:1500])
PY
    ;;
  args)
    stamp args
    if [ -f benchmarks/megatron_args_check.py ]; then
      timeout 240 python3 benchmarks/megatron_args_check.py > "$OUT/megatron_args_check.txt" 2>&1
      echo "exit status $?" >> "$OUT/megatron_args_check.txt"; tail -12 "$OUT/megatron_args_check.txt"
    else echo "benchmarks/megatron_args_check.py absent" > "$OUT/megatron_args_check.txt"; fi ;;
  runs)
    stamp runs; python3 benchmarks/gpu/runner.py --out "$OUT" "${runner_args[@]}" ;;
  *) echo "unknown stage $st"; exit 2 ;;
  esac
done
stamp done
