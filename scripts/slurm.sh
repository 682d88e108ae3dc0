#!/usr/bin/env bash
# A real one-node Slurm on this machine (Debian's slurmctld + slurmd + munge), for the Slurm
# tests (`pytest -m cluster`, tests/test_slurm.py):
#
#   scripts/slurm.sh up DIR      configure and start munged, slurmctld and slurmd; DIR holds
#                                every file (slurm.conf, munge key and socket, state, logs)
#   scripts/slurm.sh env DIR     print the variables its clients need: eval "$(scripts/slurm.sh env DIR)"
#   scripts/slurm.sh down DIR    cancel every job, stop the daemons
#
# Nothing under /etc is written: the daemons get DIR/slurm.conf with -f, the clients
# (sbatch, srun, squeue) SLURM_CONF=DIR/slurm.conf, and munge a key and socket of its own. The
# node is this host (its short name, CPUs = nproc) in partition "debug"; no cgroups
# (proctrack/linuxproc, task/none), root runs everything. Every wait is bounded; `up` stops what
# it started when a step fails or it is interrupted.
#
# Needs root and scripts/install_cluster_deps.sh. MGPU_SLURM_PORT (default 16817) is the
# controller's port, +1 the slurmd's.
set -euo pipefail

die() { echo "scripts/slurm.sh: $*" >&2; exit 2; }
usage() { die "usage: scripts/slurm.sh up DIR | env DIR | down DIR"; }

cmd_env() {
  echo "export SLURM_CONF=$1/slurm.conf"
}

stop_pid() {  # stop_pid FILE: TERM, then KILL after 3 s
  local file=$1 pid round
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  kill -TERM "$pid" 2>/dev/null || { rm -f "$file"; return 0; }
  for round in $(seq 30); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$file"
}

cmd_down() {
  local dir=$1 round
  [ -f "$dir/slurm.conf" ] || return 0
  if [ -f "$dir/slurmctld.job" ]; then
    SLURM_CONF=$dir/slurm.conf scancel --full --quiet --user=root 2>/dev/null || true
    for round in $(seq 50); do  # until no job is left (5 s at most)
      [ -z "$(SLURM_CONF=$dir/slurm.conf squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  stop_pid "$dir/slurmd.job"
  stop_pid "$dir/slurmctld.job"
  stop_pid "$dir/munged.job"
}

cmd_up() {
  local dir=$1 node cpus port round
  [ "$(id -u)" -eq 0 ] || die "up needs root (munge and slurmd run as root)"
  for program in munged mungekey slurmctld slurmd sbatch; do
    command -v "$program" > /dev/null || [ -x "/usr/sbin/$program" ] \
      || die "no $program: run scripts/install_cluster_deps.sh"
  done
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ ! -f "$dir/slurmctld.job" ] || die "$dir already holds a running Slurm: run down first"
  UP_DIR=$dir  # global: the traps run after this function's locals are gone
  trap 'cmd_down "$UP_DIR"; exit 130' INT TERM
  trap '[ $? -eq 0 ] || cmd_down "$UP_DIR"' EXIT
  node=$(hostname -s)
  cpus=$(nproc)
  port=${MGPU_SLURM_PORT:-16817}
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
  chmod 700 "$dir/munge"
  /usr/sbin/mungekey --create --keyfile="$dir/munge/munge.key" --force
  cat > "$dir/slurm.conf" <<CONF
ClusterName=mgpu
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
  /usr/sbin/munged --foreground --force --key-file="$dir/munge/munge.key" \
    --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" \
    > "$dir/munged.out" 2>&1 < /dev/null &
  echo $! > "$dir/munged.job"
  for round in $(seq 50); do [ -S "$dir/munge/munge.socket" ] && break; sleep 0.1; done
  [ -S "$dir/munge/munge.socket" ] || die "munged did not start: $(tail -3 "$dir/munged.out")"
  /usr/sbin/slurmctld -D -i -f "$dir/slurm.conf" > "$dir/slurmctld.out" 2>&1 < /dev/null &
  echo $! > "$dir/slurmctld.job"
  /usr/sbin/slurmd -D -f "$dir/slurm.conf" > "$dir/slurmd.out" 2>&1 < /dev/null &
  echo $! > "$dir/slurmd.job"
  # Ready when the node is idle in the partition (bounded: 150 x 0.2 s).
  for round in $(seq 150); do
    if SLURM_CONF=$dir/slurm.conf sinfo -h -N -o %t 2>/dev/null | grep -qx idle; then
      echo "slurm up in $dir: node $node, $cpus CPUs, partition debug"
      return 0
    fi
    for daemon in munged slurmctld slurmd; do
      kill -0 "$(cat "$dir/$daemon.job")" 2>/dev/null \
        || die "$daemon died: $(tail -5 "$dir/$daemon.out" "$dir/$daemon.log" 2>/dev/null)"
    done
    sleep 0.2
  done
  die "the node did not become idle in 30 s; logs: $dir/slurmctld.log $dir/slurmd.log"
}

[ $# -eq 2 ] || usage
case $1 in
  up) cmd_up "$2" ;;
  env) cmd_env "$(cd "$2" && pwd)" ;;
  down) cmd_down "$(cd "$2" && pwd)" ;;
  *) usage ;;
esac
