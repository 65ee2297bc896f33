#!/usr/bin/env bash
# Install mcore-advisor with its job and test extras into .venv, start what the integration tests
# use (shellcheck and a local Slurm, when run as root on Debian), and run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k memory`.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-}
if [ -z "$py" ]; then
  # megatron-core 0.16.1 (the CPU test path) is the newest release for Python 3.11.
  if command -v python3.11 >/dev/null 2>&1; then py=python3.11; else py=python3; fi
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
# torch is pinned to the CPU build this machine kind ships; a bare 'torch' may pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" "megatron-core==0.16.1" -e ".[job,test]"

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! command -v shellcheck >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null \
      || echo "test.sh: could not install shellcheck; its checks will be skipped" >&2
  fi
  if slurm_env=$(scripts/slurm/up.sh --env 2>/dev/null); then
    eval "$slurm_env"
  else
    echo "test.sh: local Slurm did not come up; Slurm tests will be skipped" >&2
  fi
fi

exec .venv/bin/python -m pytest -q "$@"
