#!/usr/bin/env bash
# A real SLURM cluster on this machine for the tests marked `slurm`: two nodes (two slurmd -N on one
# host), a `main` partition and an `urgent` one that preempts it (PreemptMode=REQUEUE).
#
#   tests/slurm/cluster.sh up      install (apt-get) and start munged, slurmctld, slurmd n1 and n2
#   tests/slurm/cluster.sh down    cancel its jobs and stop exactly the daemons `up` started (by PID)
#   tests/slurm/cluster.sh env     print the SLURM_CONF line a shell needs to use the cluster
#
# Everything lives in $LIT_CBS_SLURM_DIR (default /tmp/lit_cbs-slurm): slurm.conf, state, logs, PID
# files. The cluster listens on ports of its own (16817, 17001, 17002) and never reads
# /etc/slurm/slurm.conf, so a machine that already runs SLURM is not disturbed: use it with
# SLURM_CONF=$LIT_CBS_SLURM_DIR/slurm.conf. A munged that already runs is used and left running.
# Needs root (the daemons run as root, jobs as the submitting user) and Debian's packages
# (slurmctld, slurmd, slurm-client, munge: about 14 MB). No systemd is needed.
#
# What was found on Debian 12 (SLURM 22.05) and is handled here:
# - without systemd, /run/munge (the unit's RuntimeDirectory) is missing: created here;
# - a requeued job may start again only after the credential lifetime (120 s by default) and the
#   next scheduler pass (60 s): both are shortened (cred_expire=10, sched_interval=2);
# - torch.distributed and Lightning take the first node's name as MASTER_ADDR: n1 and n2 resolve to
#   127.0.0.1 through lines this script adds to /etc/hosts (and removes at `down`).
set -euo pipefail

DIR=${LIT_CBS_SLURM_DIR:-/tmp/lit_cbs-slurm}
CONF=$DIR/slurm.conf
HOSTS_MARK="# lit_cbs test cluster"

say() { printf 'slurm cluster: %s\n' "$*" >&2; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfiles() {  # stop the daemons whose PIDs the files hold, those alive, together; wait up to 10 s, then SIGKILL
  local file pid running pids=()
  for file in "$@"; do
    if alive "$file"; then pid=$(cat "$file"); pids+=("$pid"); kill "$pid"; fi
    rm -f "$file"
  done
  for _ in $(seq 100); do
    running=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && running=1; done
    [ "$running" = 0 ] && return 0
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
}

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null && return 0
  command -v apt-get >/dev/null || { say "no apt-get to install slurmctld, slurmd, slurm-client and munge"; return 1; }
  # The packages' postinst scripts cannot start services without systemd ("policy-rc.d denied"): harmless.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge \
    >"$DIR/apt.log" 2>&1 || {
    apt-get update -q >>"$DIR/apt.log" 2>&1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge \
      >>"$DIR/apt.log" 2>&1
  } || { say "apt-get install failed (see $DIR/apt.log)"; return 1; }
}

start_munge() {
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key && chmod 0600 /etc/munge/munge.key
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/log/munge
  install -d -o munge -g munge -m 0711 /var/lib/munge
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged  # forks; its PID file is /run/munge/munged.pid
    cp /run/munge/munged.pid "$DIR/munged.pid"  # ours to stop at `down`
  fi
  for _ in $(seq 25); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.2; done
  say "munged does not answer"; return 1
}

write_conf() {
  local cpus mem
  cpus=1  # per node: the two nodes share this machine's cores
  mem=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 / 4 ))  # MB per node: a quarter of the RAM
  mkdir -p "$DIR/state" "$DIR/log" "$DIR/spool-n1" "$DIR/spool-n2"
  cat >"$CONF" <<EOF
ClusterName=litcbs
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MailProg=/bin/true
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=5
MinJobAge=600
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=n1 NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=17001 CPUs=$cpus RealMemory=$mem
NodeName=n2 NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=17002 CPUs=$cpus RealMemory=$mem
PartitionName=main   Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=n1,n2 Default=NO  MaxTime=INFINITE State=UP PriorityTier=10 GraceTime=30
EOF
}

add_hosts() {
  grep -q "$HOSTS_MARK" /etc/hosts || printf '127.0.0.1 n1 n2 %s\n' "$HOSTS_MARK" >>/etc/hosts
}

remove_hosts() {
  # Rewritten in place (cat >), not replaced: /etc/hosts may be a bind mount.
  if grep -q "$HOSTS_MARK" /etc/hosts; then
    grep -v "$HOSTS_MARK" /etc/hosts >"$DIR/hosts" && cat "$DIR/hosts" >/etc/hosts
  fi
}

wait_idle() {
  local states=""
  for _ in $(seq 60); do
    states=$(SLURM_CONF=$CONF sinfo -h -N -o '%T' 2>/dev/null | sort -u | tr '\n' ' ')
    [ "$states" = "idle " ] && return 0
    sleep 0.5
  done
  say "nodes are not idle: $states (logs in $DIR/log)"; return 1
}

up() {
  [ "$(id -u)" = 0 ] || { say "needs root to run the SLURM daemons (uid $(id -u))"; return 1; }
  mkdir -p "$DIR"
  install_packages
  start_munge
  write_conf
  add_hosts
  export SLURM_CONF=$CONF
  alive "$DIR/slurmctld.pid" || slurmctld
  alive "$DIR/slurmd-n1.pid" || slurmd -N n1
  alive "$DIR/slurmd-n2.pid" || slurmd -N n2
  wait_idle
  say "up: SLURM_CONF=$CONF"
}

down() {
  export SLURM_CONF=$CONF
  if alive "$DIR/slurmctld.pid"; then
    scancel --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 30); do squeue -h 2>/dev/null | grep -q . || break; sleep 1; done
  fi
  stop_pidfiles "$DIR/slurmd-n1.pid" "$DIR/slurmd-n2.pid" "$DIR/slurmctld.pid"  # slurmscriptd exits with slurmctld
  stop_pidfiles "$DIR/munged.pid"  # only if `up` started it
  remove_hosts
  rm -rf "$DIR/state" "$DIR/spool-n1" "$DIR/spool-n2"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) echo "SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
