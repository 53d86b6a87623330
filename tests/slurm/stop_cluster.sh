#!/usr/bin/env bash
# Stop the daemons started by start_cluster.sh (slurmd, slurmctld, slurmdbd, mariadb, munged).
# State stays in RELAX_SLURM_DIR so a later start is quick; pass --purge to delete it as well.
set -uo pipefail

D="${RELAX_SLURM_DIR:-/tmp/relax-slurm}"

stop_pidfile() {  # stop_pidfile NAME PIDFILE: SIGTERM, wait up to 10 s, then SIGKILL
  local name=$1 pidfile=$2 pid
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null; fi
    echo "stopped $name ($pid)" >&2
  fi
  rm -f "$pidfile"
}

# Jobs first, so their steps do not linger after slurmd is gone.
if [ -f "$D/etc/slurm.conf" ] && command -v scancel >/dev/null; then
  SLURM_CONF="$D/etc/slurm.conf" timeout 10 scancel --full --user=root 2>/dev/null || true
fi
# Two waves in parallel (shutdown takes 1-3 s each); slurmctld flushes job records to slurmdbd first.
for f in "$D"/run/slurmd-*.pid; do stop_pidfile "$(basename "$f" .pid)" "$f" & done
stop_pidfile slurmctld "$D/run/slurmctld.pid" & wait
stop_pidfile slurmdbd "$D/run/slurmdbd.pid" & stop_pidfile mariadb "$D/run/mariadb.pid" & wait
# munged is system-wide (/run/munge); stop it only when it runs the way start_cluster.sh started it.
stop_pidfile munged /run/munge/munged.pid

if [ "${1:-}" = "--purge" ]; then
  rm -rf "$D"
  echo "removed $D" >&2
fi
