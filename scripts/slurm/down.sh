#!/bin/bash
# Stop exactly the daemons scripts/slurm/up.sh started (each by its recorded PID), dependents first.
# Leaves $SLURM_RUN_DIR (logs, state) for inspection; `rm -rf` it to start from scratch.
set -uo pipefail
RUN=${SLURM_RUN_DIR:-/tmp/mcore-advisor-slurm}
for name in slurmrestd slurmd-node2 slurmd-node1 slurmctld munged; do
  f="$RUN/run/$name.daemon.pid"
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL "$pid" 2>/dev/null
      echo "killed $name ($pid) after TERM timed out"
    else
      echo "stopped $name ($pid)"
    fi
  fi
  rm -f "$f"
done
rm -f "$RUN/env.sh"
