#!/bin/bash
# Bring up a throwaway single-host Slurm 22.05 for mcore-advisor's integration tests (root, no systemd):
#   munged (unless one already answers) + slurmctld + 2 emulated slurmd (node1, node2; 8 fake H100 GRES each)
#   + slurmrestd with JWT auth on 127.0.0.1:$SLURMRESTD_PORT.
# Installs the Debian 12 packages it needs. Idempotent: a second run finds the cluster up and only reprints
# the environment. State, logs and the JWT key live in $SLURM_RUN_DIR (default /tmp/mcore-advisor-slurm);
# scripts/slurm/down.sh stops exactly the daemons this script started.
#
#   sudo scripts/slurm/up.sh            # prints: export SLURM_CONF=... SLURM_JWT=... SLURM_REST_URL=...
#   eval "$(scripts/slurm/up.sh --env)" # the same, quiet, for a shell
#   SLURM_RUN_DIR=/tmp/x scripts/slurm/up.sh
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
RUN=${SLURM_RUN_DIR:-/tmp/mcore-advisor-slurm}
HOST=$(hostname -s)
CTLD_PORT=${SLURMCTLD_PORT:-6817}
REST_PORT=${SLURMRESTD_PORT:-6820}
NODE_PORTS=${SLURMD_PORTS:-17001-17002}
QUIET=0
[ "${1:-}" = "--env" ] && QUIET=1

say() { [ "$QUIET" = 1 ] || echo "$@" >&2; }

if [ "$(id -u)" != 0 ]; then
  echo "up.sh must run as root (it installs packages and starts slurmctld/slurmd)" >&2
  exit 1
fi

export SLURM_CONF="$RUN/etc/slurm.conf"

print_env() {
  # A fresh token each time: the default lifespan is short, the tests may run long.
  local tok
  tok=$(scontrol token username=root lifespan=86400 | sed -n 's/^SLURM_JWT=//p')
  {
    echo "export SLURM_CONF=$SLURM_CONF"
    echo "# SLURM_JWT is for slurmrestd clients. Slurm's own CLI also switches to JWT when it is set: fine for"
    echo "# sbatch/squeue/scontrol (slurmctld accepts it) but srun talks to slurmd, which only speaks munge;"
    echo "# rendered sbatch scripts therefore unset it before srun."
    echo "export SLURM_JWT=$tok"
    echo "export SLURM_REST_URL=http://127.0.0.1:$REST_PORT"
    echo "export SLURM_REST_USER=root"
    echo "export SLURM_RUN_DIR=$RUN"
  } > "$RUN/env.sh"
  cat "$RUN/env.sh"
}

alive() {  # name -> 0 when the daemon recorded under that name still runs
  local f="$RUN/run/$1.daemon.pid"
  [ -f "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null
}

all_idle() {
  [ "$(sinfo -h -N -o %T 2>/dev/null | sort -u | tr -d '\n')" = "idle" ]
}

if alive slurmctld && alive slurmd-node1 && alive slurmd-node2 && alive slurmrestd \
   && scontrol ping >/dev/null 2>&1; then
  say "slurm already up in $RUN"
  print_env
  exit 0
fi

# --- packages (Debian 12 ships Slurm 22.05.8; the JWT plugin is a separate package) ---
pkgs="slurm-wlm slurmctld slurmd slurmrestd slurm-client slurm-wlm-jwt-plugin munge"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  say "installing:$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  # shellcheck disable=SC2086  # word splitting of the package list is intended
  apt-get install -y -q --no-install-recommends $missing >&2
fi

# --- a half-started earlier run: stop what is left before starting again ---
if [ -d "$RUN/run" ]; then
  SLURM_RUN_DIR="$RUN" "$HERE/down.sh" >&2 || true
fi

mkdir -p "$RUN"/{etc,log,run,state/ctld,state/d,dev,jobs}
chown slurm:slurm "$RUN/state/ctld" "$RUN/log"
chmod 0755 "$RUN" "$RUN/etc"
# Jobs of any user write their logs here.
chmod 1777 "$RUN/jobs"
for i in 0 1 2 3 4 5 6 7; do [ -e "$RUN/dev/nvidia$i" ] || mknod "$RUN/dev/nvidia$i" c 1 3; done
[ -s "$RUN/etc/jwt_hs256.key" ] || dd if=/dev/urandom of="$RUN/etc/jwt_hs256.key" bs=32 count=1 status=none
chown slurm:slurm "$RUN/etc/jwt_hs256.key"
chmod 0600 "$RUN/etc/jwt_hs256.key"

render() {  # template -> output, filling the @...@ placeholders
  sed -e "s|@RUN@|$RUN|g" -e "s|@HOST@|$HOST|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
      -e "s|@NODE_PORTS@|$NODE_PORTS|g" "$1" > "$2"
}
render "$HERE/slurm.conf.in" "$RUN/etc/slurm.conf"
render "$HERE/gres.conf.in" "$RUN/etc/gres.conf"

start() {  # name, command...: runs it detached, records the daemon's own PID in $RUN/run/<name>.daemon.pid
  local name=$1
  shift
  setsid "$@" > "$RUN/log/$name.stdout" 2>&1 < /dev/null &
  echo $! > "$RUN/run/$name.daemon.pid"
}

wait_for() {  # what, tries (0.2 s apart), command...
  local what=$1 tries=$2
  shift 2
  for _ in $(seq "$tries"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "timed out waiting for $what; logs in $RUN/log" >&2
  tail -n 20 "$RUN"/log/*.log "$RUN"/log/*.stdout >&2 2>/dev/null || true
  return 1
}

# munge: reuse a running munged (libmunge's default socket), else start one as user munge.
# setpriv execs (no wrapper process), so the recorded PID is munged itself.
if ! munge -n >/dev/null 2>&1; then
  install -d -o munge -g munge -m 0755 /run/munge
  start munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F
  wait_for munged 50 munge -n
fi

# -c: start from a clean job table; a throwaway cluster must not resume jobs of an earlier run.
start slurmctld /usr/sbin/slurmctld -D -c -f "$SLURM_CONF"
wait_for slurmctld 75 scontrol ping
for n in node1 node2; do start "slurmd-$n" /usr/sbin/slurmd -D -N "$n" -f "$SLURM_CONF"; done

# slurmrestd refuses root and SlurmUser: -u drops to nobody after binding. SLURM_JWT=daemon makes it
# forward each caller's token to slurmctld. Only openapi/v0.0.38: the dbv plugin is fatal without slurmdbd.
SLURM_JWT=daemon start slurmrestd /usr/sbin/slurmrestd -a rest_auth/jwt -s openapi/v0.0.38 -u nobody \
  "127.0.0.1:$REST_PORT"

wait_for "nodes idle" 150 all_idle
wait_for slurmrestd 50 bash -c "exec 3<>/dev/tcp/127.0.0.1/$REST_PORT"
[ "$QUIET" = 1 ] || sinfo -N -o "%N %T %c %G" >&2
print_env
