#!/usr/bin/env bash
# Start a real single-node Slurm cluster (with accounting) on 127.0.0.1, without systemd.
#
#   eval "$(tests/slurm/start_cluster.sh)"     # or: source "$RELAX_SLURM_DIR/env.sh" afterwards
#
# Installs the Debian packages when missing, writes all config/state/logs under RELAX_SLURM_DIR
# (default /tmp/relax-slurm), starts munged, mariadb, slurmdbd, slurmctld and slurmd, and returns once an
# sbatch job has run and been accounted. Safe to re-run while the cluster is up. Needs root.
# RELAX_SLURM_NODES=N (default 1) runs N slurmd on this host as N virtual nodes (each with all CPUs),
# so multi-node code paths (srun across nodes, Ray workers joining a head) can be tested on one machine.
# Only `export SLURM_CONF=...` goes to stdout; progress goes to stderr.
set -euo pipefail

D="${RELAX_SLURM_DIR:-/tmp/relax-slurm}"
DB_PORT="${RELAX_SLURM_DB_PORT:-3307}"           # not 3306, so a distro mariadb cannot clash
MEM_HEADROOM_MB="${RELAX_SLURM_MEM_HEADROOM_MB:-1024}"
NODES="${RELAX_SLURM_NODES:-1}"
CLUSTER=relax
HOST="$(hostname -s)"
CONF="$D/etc/slurm.conf"
T0=$EPOCHREALTIME

log() { printf '[slurm %5.1fs] %s\n' "$(awk "BEGIN{print $EPOCHREALTIME - $T0}")" "$*" >&2; }
die() { log "ERROR: $*"; for f in "$D"/log/*.log; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 15 "$f" >&2; }; done; exit 1; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }
wait_for() {  # wait_for SECONDS DESCRIPTION CMD...
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -lt $end ] || die "timed out after ${limit}s waiting for $what"
    sleep 0.2
  done
}
[ "$(id -u)" = 0 ] || { echo "start_cluster.sh must run as root" >&2; exit 1; }
# the daemons and runuser live in sbin, which a root shell's PATH may lack (su without -, minimal CI envs)
export PATH="/usr/local/sbin:/usr/sbin:/sbin:$PATH"

mkdir -p "$D"/{etc,state,spool,log,run,mysql}

# --- packages -------------------------------------------------------------------------------------
PKGS=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server mariadb-client)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  # Keep postinst scripts from starting daemons through init scripts; we start our own below.
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && made_policy=1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Refresh package lists only when the install cannot find the packages (fresh image).
  if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$D/log/apt.log" 2>&1; then
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
      >"$D/log/apt.log" 2>&1 || die "apt-get failed (see $D/log/apt.log)"
  fi
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  log "packages installed"
fi

# --- config ---------------------------------------------------------------------------------------
CPUS=$(nproc)
MEM_MB=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 - MEM_HEADROOM_MB ))
if [ "$NODES" = 1 ]; then
  NAMES=("$HOST")
  node_lines="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
else  # virtual nodes share the host: distinct names and slurmd ports, memory split between them
  NAMES=(); node_lines=""
  for i in $(seq "$NODES"); do
    NAMES+=("$HOST-v$i")
    node_lines+="NodeName=$HOST-v$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((6820 + i)) CPUs=$CPUS"
    node_lines+=" RealMemory=$((MEM_MB / NODES)) State=UNKNOWN"$'\n'
  done
fi
ALL_NODES=$(IFS=,; echo "${NAMES[*]}")

new_conf=$(cat <<EOF
# Written by tests/slurm/start_cluster.sh: $NODES node(s) on 127.0.0.1, accounting through slurmdbd.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
# No systemd/cgroups here: track processes by parentage, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
MailProg=/bin/true
# Trust the node line below even if the hardware probe differs (containers, CI runners).
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
$node_lines
PartitionName=debug Nodes=$ALL_NODES Default=YES MaxTime=INFINITE State=UP
EOF
)
new_dbd=$(cat <<EOF
AuthType=auth/munge
DbdAddr=127.0.0.1
DbdHost=$HOST
DbdPort=6819
SlurmUser=root
PidFile=$D/run/slurmdbd.pid
LogFile=$D/log/slurmdbd.log
StorageType=accounting_storage/mysql
# 127.0.0.1, not localhost: localhost makes the client use the default unix socket.
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=relax
StorageLoc=slurm_acct_db
EOF
)
conf_changed=0
if [ "$(cat "$CONF" 2>/dev/null)" != "$new_conf" ]; then
  printf '%s\n' "$new_conf" >"$CONF"; conf_changed=1
fi
printf '%s\n' "$new_dbd" >"$D/etc/slurmdbd.conf"
chmod 600 "$D/etc/slurmdbd.conf"   # slurmdbd refuses a world-readable config holding a password
export SLURM_CONF="$CONF"
printf 'export SLURM_CONF=%s\n' "$CONF" >"$D/env.sh"

# A changed node/config line needs fresh slurm daemons; the database can stay.
if [ $conf_changed = 1 ]; then
  for f in "$D"/run/slurmd-*.pid "$D/run/slurmctld.pid"; do
    if alive "$f"; then log "config changed: stopping $(basename "$f" .pid)"; kill "$(cat "$f")"; fi
  done
  for f in "$D"/run/slurmd-*.pid "$D/run/slurmctld.pid"; do
    for _ in $(seq 100); do alive "$f" || break; sleep 0.1; done
    rm -f "$f"
  done
fi

# --- munge ----------------------------------------------------------------------------------------
if ! (munge -n | unmunge) >/dev/null 2>&1; then
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
  chmod 400 /etc/munge/munge.key
  chmod 755 /run/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged --force
  wait_for 15 munged sh -c 'munge -n | unmunge'
  log "munged up"
fi

# --- mariadb (own datadir and port) ----------------------------------------------------------------
SOCK="$D/run/mysqld.sock"
sql() { mariadb --no-defaults -S "$SOCK" -u root "$@"; }
if ! mariadb-admin --no-defaults -S "$SOCK" -u root ping >/dev/null 2>&1; then
  if [ ! -d "$D/mysql/mysql" ]; then
    mariadb-install-db --no-defaults --datadir="$D/mysql" --user=root --skip-test-db \
      --auth-root-authentication-method=socket >"$D/log/mariadb-install.log" 2>&1 \
      || die "mariadb-install-db failed (see $D/log/mariadb-install.log)"
  fi
  setsid mariadbd --no-defaults --datadir="$D/mysql" --socket="$SOCK" --port="$DB_PORT" \
    --bind-address=127.0.0.1 --user=root --pid-file="$D/run/mariadb.pid" --skip-name-resolve \
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
    --log-error="$D/log/mariadb.log" </dev/null >/dev/null 2>&1 &
  wait_for 30 mariadb mariadb-admin --no-defaults -S "$SOCK" -u root ping
  log "mariadb up on 127.0.0.1:$DB_PORT"
fi
sql -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'relax';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "could not create the slurm db user"

# --- slurmdbd -------------------------------------------------------------------------------------
if ! alive "$D/run/slurmdbd.pid"; then
  setsid slurmdbd </dev/null >>"$D/log/slurmdbd.stdout" 2>&1   # daemonizes; finds its conf via SLURM_CONF
  wait_for 30 slurmdbd sacctmgr -n show cluster
  log "slurmdbd up"
fi
# slurmctld registers only with a cluster that exists in the database.
if [ -z "$(sacctmgr -n -P show cluster "$CLUSTER" format=cluster)" ]; then
  sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null
fi
if [ -z "$(sacctmgr -n -P show account relax format=account)" ]; then
  sacctmgr -i -Q add account relax cluster="$CLUSTER" description=relax organization=relax >/dev/null
fi
if [ -z "$(sacctmgr -n -P show user root format=user)" ] || \
   [ -z "$(sacctmgr -n -P show assoc cluster="$CLUSTER" account=relax user=root format=user)" ]; then
  sacctmgr -i -Q add user root account=relax cluster="$CLUSTER" >/dev/null || true
fi

# --- slurmctld + slurmd ---------------------------------------------------------------------------
if ! alive "$D/run/slurmctld.pid"; then
  setsid slurmctld -f "$CONF" </dev/null >>"$D/log/slurmctld.stdout" 2>&1
  wait_for 30 slurmctld sh -c 'scontrol ping | grep -q UP'
  log "slurmctld up"
fi
mkdir -p "$D/spool"
for n in "${NAMES[@]}"; do
  if ! alive "$D/run/slurmd-$n.pid"; then
    setsid slurmd -f "$CONF" -N "$n" </dev/null >>"$D/log/slurmd.stdout" 2>&1
    log "slurmd $n started"
  fi
done
if sinfo -h -N -o %T | grep -Eq '^(down|drain|fail)'; then
  scontrol update nodename="$ALL_NODES" state=resume 2>/dev/null || true
fi
up_nodes() { sinfo -h -N -o %T | grep -Ec '^(idle|mixed|allocated)'; }
wait_for 30 "$NODES node(s) up" sh -c "[ \$(sinfo -h -N -o %T | grep -Ec '^(idle|mixed|allocated)') -ge $NODES ]"
log "nodes $ALL_NODES up ($(up_nodes)/$NODES), CPUs=$CPUS RealMemory=${MEM_MB}MB in all"

# --- smoke test: a job runs and is accounted ------------------------------------------------------
# Poll sacct ourselves: `sbatch --wait` backs off to multi-second polls and wastes ~7 s here.
jid=$(sbatch --parsable --output="$D/log/smoke-%j.out" --wrap hostname) || die "sbatch failed"
end=$((SECONDS + 60))
until [ "$(sacct -n -X -j "$jid" -o State 2>/dev/null | tr -d ' ')" = COMPLETED ]; do
  st=$(sacct -n -X -j "$jid" -o State 2>/dev/null | tr -d ' ')
  case "$st" in FAILED|CANCELLED*|TIMEOUT|NODE_FAIL|OUT_OF_ME*) die "smoke job $jid ended $st" ;; esac
  [ $SECONDS -lt $end ] || die "smoke job $jid not COMPLETED in sacct after 60s (state: ${st:-none})"
  sleep 0.2
done
log "smoke job $jid COMPLETED and accounted; cluster ready"

printf 'export SLURM_CONF=%s\n' "$CONF"
