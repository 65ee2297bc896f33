#!/usr/bin/env bash
# Install mcore-advisor with its job and test extras into .venv, start what the integration tests
# use (shellcheck and a local Slurm, when run as root on Debian), and run the whole test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k memory`.
set -euo pipefail
cd "$(dirname "$0")/.."

# The profile job runs megatron.training (megatron-core >= 0.17), which needs Python >= 3.12.
# A pyenv shim answers `command -v python3.12` even where 3.12 is not the active version and then
# fails, so each candidate must actually run.
is_312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
py=""
for cand in "${PYTHON:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if is_312 "$cand"; then py=$cand; break; fi
done
[ -n "$py" ] || { echo "test.sh: no Python 3.12 found; set PYTHON to one (megatron-core >= 0.17 needs it)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$py" -m venv .venv
# PyPI's torch for 3.12 is its CUDA build: it runs on the CPU too and brings triton, which
# megatron-core 0.19.2 imports (about 2 minutes and 5.5 GB for the whole install).
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.14.1" "megatron-core==0.19.2" -e ".[job,test]"

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! command -v shellcheck >/dev/null 2>&1; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null \
      || echo "test.sh: could not install shellcheck; its checks will be skipped" >&2
  fi
  # Stop on exit the daemons this run starts (not a cluster that was already up); KEEP_SLURM=1 keeps them.
  ctld_pid="${SLURM_RUN_DIR:-/tmp/mcore-advisor-slurm}/run/slurmctld.daemon.pid"
  slurm_was_up=0
  if [ -f "$ctld_pid" ] && kill -0 "$(cat "$ctld_pid")" 2>/dev/null; then slurm_was_up=1; fi
  if slurm_env=$(scripts/slurm/up.sh --env 2>/dev/null); then
    eval "$slurm_env"
    if [ "$slurm_was_up" = 0 ] && [ "${KEEP_SLURM:-0}" != 1 ]; then
      trap 'scripts/slurm/down.sh >/dev/null || echo "test.sh: scripts/slurm/down.sh failed" >&2' EXIT
    fi
  else
    echo "test.sh: local Slurm did not come up; Slurm tests will be skipped" >&2
  fi
fi

# real MCP clients (MCP Inspector CLI, skills CLI) for tests/server/test_inspector.py and test_skill.py
scripts/install_clients.sh
.venv/bin/python -m pytest -q "$@"
