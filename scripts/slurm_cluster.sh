#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine (Debian's slurmctld, slurmd and munge), for the SLURM tests.
#
#   bash scripts/slurm_cluster.sh up      # install if needed, start; prints `export SLURM_CONF=...`
#   bash scripts/slurm_cluster.sh down    # stop what `up` started and remove its state
#   bash scripts/slurm_cluster.sh status  # exit 0 when the cluster answers
#
# Needs root and apt (Debian 12: SLURM 22.05). No systemd: the packages are kept from starting services while
# they install, and the daemons run in the background with their state, logs and configuration under
# $DDPKIT_SLURM_DIR (default /tmp/ddpkit-slurm). Nothing under /etc is changed except munge's key, created if
# the package left none. Idempotent: `up` on a running cluster only checks it; `down` twice is fine.
set -euo pipefail
dir="${DDPKIT_SLURM_DIR:-/tmp/ddpkit-slurm}"
conf="$dir/slurm.conf"
cpus="${DDPKIT_SLURM_CPUS:-8}"  # what slurmd announces (config_overrides): room for two 2-task jobs on 2 cores

say() { echo "slurm_cluster: $*" >&2; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return 0
  [ "$(id -u)" = 0 ] || { say "installing SLURM needs root"; exit 3; }
  command -v apt-get >/dev/null || { say "installing SLURM needs apt-get (Debian/Ubuntu)"; exit 3; }
  # Keep the packages' maintainer scripts from starting daemons (there is no systemd here, and we start our own).
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
  fi
  say "installing slurmctld slurmd slurm-client munge"
  # One apt-get at a time (the test suite's other set-ups may install at the same moment): flock.
  flock -w 900 /tmp/ddpkit-apt.lock sh -c 'apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge' \
    >"${TMPDIR:-/tmp}/ddpkit-slurm-apt.log" 2>&1 || { say "apt-get failed; see ${TMPDIR:-/tmp}/ddpkit-slurm-apt.log"; exit 3; }
  [ "$created_policy" = 0 ] || rm -f "$policy"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

answers() { SLURM_CONF="$conf" timeout 5 sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }

up() {
  install_packages
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" && answers; then
    echo "export SLURM_CONF=$conf"
    return 0
  fi
  [ "$(id -u)" = 0 ] || { say "starting slurmd needs root"; exit 3; }
  local host
  host="$(hostname -s)"
  cat >"$conf" <<EOF
# Written by ddpkit's scripts/slurm_cluster.sh: a one-node test cluster.
ClusterName=ddpkit
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=${DDPKIT_SLURMCTLD_PORT:-6917}
SlurmdPort=${DDPKIT_SLURMD_PORT:-6918}
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
MpiDefault=none
KillWait=30
InactiveLimit=0
MinJobAge=600
SlurmdTimeout=60
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  # munge: the key, a run folder owned by munge, and the daemon as that user.
  [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if ! alive "$dir/munged.pid"; then
    if pgrep -u munge -x munged >/dev/null && [ -S /run/munge/munge.socket.2 ]; then
      : # a munged that is not ours already serves /run/munge: use it, leave it alone
    else
      su -s /bin/sh munge -c munged
      for _ in $(seq 1 50); do  # munged forks into the background: wait for the daemon's socket
        [ -S /run/munge/munge.socket.2 ] && break
        sleep 0.1
      done
      pgrep -n -u munge -x munged >"$dir/munged.pid" || true  # the newest: the daemon, not its exiting parent
    fi
  fi
  alive "$dir/slurmctld.pid" || SLURM_CONF="$conf" slurmctld -f "$conf" -i
  alive "$dir/slurmd.pid" || SLURM_CONF="$conf" slurmd -f "$conf"
  local deadline=$((SECONDS + 60))
  while [ $SECONDS -lt $deadline ]; do
    answers && { echo "export SLURM_CONF=$conf"; return 0; }
    sleep 0.3
  done
  say "the cluster did not come up within 60 s; logs in $dir/log"
  tail -n 20 "$dir/log/"*.log >&2 || true
  exit 4
}

down() {
  for daemon in slurmd slurmctld munged; do
    if alive "$dir/$daemon.pid"; then
      local pid
      pid="$(cat "$dir/$daemon.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$dir"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) answers ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
