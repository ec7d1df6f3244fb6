#!/usr/bin/env bash
# A throw-away Slurm cluster on this one machine (Debian/Ubuntu, as root), for trying sbatch scripts locally and
# for CI. N simulated nodes n1..nN share the host; everything lives in one state directory.
#
#   launch/local_slurm.sh install          # apt-get slurm-wlm pieces, munge, iproute2 (skipped if present)
#   launch/local_slurm.sh start [N]        # private munged + slurmctld + N slurmd (default N=2)
#   launch/local_slurm.sh run CMD [ARG..]  # run a Slurm client inside the cluster's network namespace
#   launch/local_slurm.sh status           # the daemons we started, and sinfo
#   launch/local_slurm.sh stop             # cancel jobs, stop exactly the daemons we started (PID files)
#
# Example, from the repository root:
#   launch/local_slurm.sh install && launch/local_slurm.sh start 2
#   launch/local_slurm.sh run sbatch -N 2 launch/train.sbatch configs/quickstart_cpu.yaml
#   launch/local_slurm.sh run squeue
#   launch/local_slurm.sh stop
#
# Settings (environment):
#   SLIMISH_SLURM_DIR        state, config, logs, PID files       (default /tmp/slimish-slurm)
#   SLIMISH_SLURM_NETNS      network namespace the cluster runs in (default slimish-slurm; empty = host network)
#   SLIMISH_SLURM_CPUS       CPUs each simulated node advertises  (default: nproc)
#   SLIMISH_SLURM_PORT       slurmctld port; node K's slurmd listens on PORT+K (default 16817)
#   SLIMISH_SLURM_PROCTRACK  proctrack/linuxproc (default) or proctrack/cgroup
#
# Isolation: the cluster has its own munge key and munged socket and its own ports, so a system Slurm or munge on
# the host is neither used nor disturbed. By default the daemons, and therefore every job, run in a network
# namespace of their own whose only interface is loopback: nothing a job starts can reach or be reached from
# outside, and programs that look for "the host's address" find 127.0.0.1 (Ray does; see launch/ray_node.sh).
# Clients must run in that namespace too, hence `run`. Daemons listen on 127.0.0.1 only
# (CommunicationParameters=NoCtldInAddrAny,NoInAddrAny with every node address being 127.0.0.1).
#
# Why proctrack/linuxproc by default: proctrack/cgroup kills whatever a job leaves behind, which would hide bugs in
# our own teardown (launch/train.sbatch must clean up after itself). Real clusters usually run proctrack/cgroup.
set -euo pipefail

D=${SLIMISH_SLURM_DIR:-/tmp/slimish-slurm}
NETNS=${SLIMISH_SLURM_NETNS-slimish-slurm}
CPUS=${SLIMISH_SLURM_CPUS:-$(nproc)}
PORT=${SLIMISH_SLURM_PORT:-16817}
PROCTRACK=${SLIMISH_SLURM_PROCTRACK:-proctrack/linuxproc}
SOCKET=$D/munge/munge.socket
export SLURM_CONF=$D/slurm.conf

die() {
  echo "local_slurm: $*" >&2
  exit 1
}

# Run a command in the cluster's network namespace (or plainly, without one).
in_ns() {
  if [[ -n $NETNS ]]; then
    nsenter --net="/run/netns/$NETNS" "$@"
  else
    "$@"
  fi
}

# True if PID file $1 names a live (non-zombie) process.
pid_alive() {
  local pid state
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  state=$(ps -o stat= -p "$pid" 2>/dev/null) || return 1
  [[ ${state:0:1} != Z ]]
}

do_install() {
  [[ $(id -u) == 0 ]] || die "install needs root (apt-get)"
  local tool missing=""
  for tool in slurmctld slurmd sbatch munged ip ps; do
    command -v "$tool" >/dev/null || missing+=" $tool"
  done
  if [[ -z $missing ]]; then
    echo "slurm and munge already installed"
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge iproute2 procps >/dev/null
}

start_netns() {
  [[ -n $NETNS ]] || return 0
  if [[ ! -e /run/netns/$NETNS ]]; then
    ip netns add "$NETNS"
    echo "$NETNS" >"$D/netns.created"
  fi
  ip -n "$NETNS" link set lo up
  # glibc's getaddrinfo(AF_INET, AI_ADDRCONFIG), which Slurm uses even for "127.0.0.1", answers nothing unless some
  # IPv4 address other than 127.0.0.1 exists; a second loopback address satisfies it without leaving loopback.
  ip -n "$NETNS" addr replace 127.0.0.2/8 dev lo
}

start_munge() {
  pid_alive "$D/munged.pid" && return 0
  # munged runs as the munge user and insists that its key and socket directory belong to that user.
  runuser -u munge -- test -x "$D" || die "the munge user cannot enter $D: choose a SLIMISH_SLURM_DIR it can reach"
  install -d -o munge -g munge -m 755 "$D/munge"
  if [[ ! -s $D/munge/munge.key ]]; then
    mungekey --create --keyfile="$D/munge/munge.key"
    chown munge:munge "$D/munge/munge.key"
    chmod 400 "$D/munge/munge.key"
  fi
  runuser -u munge -- /usr/sbin/munged --socket="$SOCKET" --key-file="$D/munge/munge.key" \
    --pid-file="$D/munge/munged.pid" --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
  cp "$D/munge/munged.pid" "$D/munged.pid"
}

write_config() {
  local n=$1
  cat >"$D/slurm.conf" <<EOF
# Written by launch/local_slurm.sh: $n simulated nodes on one host.
ClusterName=slimish-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
MailProg=/bin/true
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
ProctrackType=$PROCTRACK
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$D/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# The simulated nodes share the host's cores: each advertises CPUs=$CPUS whatever the hardware says.
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
# Keep finished jobs visible to scontrol for 10 minutes (there is no accounting database).
MinJobAge=600
# Seconds between SIGTERM and SIGKILL when a job is cancelled or runs out of time.
KillWait=30
NodeName=n[1-$n] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$((PORT + 1))-$((PORT + n))] CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$D/cgroup.conf" <<EOF
CgroupPlugin=autodetect
ConstrainCores=no
ConstrainRAMSpace=no
EOF
}

do_start() {
  local n=${1:-2} i
  [[ $n =~ ^[1-9][0-9]*$ ]] || die "start N: N must be a positive integer, got '$n'"
  command -v slurmctld >/dev/null || die "slurm is not installed: run '$0 install' first"
  if pid_alive "$D/slurmctld.pid"; then
    echo "already running (stop it first to change the node count):"
    do_status
    return 0
  fi
  mkdir -p "$D"/{state,log,spool}
  rm -rf "${D:?}"/state/* "${D:?}"/spool/*
  start_netns
  start_munge
  write_config "$n"
  # -i: ignore any saved state. Both daemons fork into the background and write their PID files.
  in_ns /usr/sbin/slurmctld -f "$SLURM_CONF" -i
  for i in $(seq 1 "$n"); do
    mkdir -p "$D/spool/n$i"
    in_ns /usr/sbin/slurmd -f "$SLURM_CONF" -N "n$i"
  done
  for _ in $(seq 1 150); do # up to 30 s until every node is idle
    if [[ $(in_ns sinfo -h -o %t 2>/dev/null | sort -u) == idle ]]; then
      in_ns sinfo -N
      return 0
    fi
    sleep 0.2
  done
  in_ns sinfo -N -o '%N %t %E' >&2 || true
  tail -n 20 "$D"/log/*.log >&2 || true
  die "slurm did not come up (logs in $D/log)"
}

do_stop() {
  local f pids="" pid alive="" jobs
  for f in "$D"/slurmctld.pid "$D"/slurmd-*.pid; do
    if pid_alive "$f"; then pids+=" $(<"$f")"; fi
  done
  if [[ -n $pids ]]; then
    # slurmstepd outlives a stopped slurmd, so cancel jobs first and let them clean up (KillWait + epilog).
    jobs=$(in_ns squeue -h -o %i 2>/dev/null || true)
    if [[ -n $jobs ]]; then
      # shellcheck disable=SC2086  # a list of job ids
      in_ns scancel --quiet $jobs 2>/dev/null || true
      for _ in $(seq 1 200); do # up to 40 s
        [[ -z $(in_ns squeue -h -o %i 2>/dev/null) ]] && break
        sleep 0.2
      done
    fi
    in_ns scontrol shutdown >/dev/null 2>&1 || true
    for _ in $(seq 1 100); do # up to 20 s
      alive=""
      for pid in $pids; do
        if kill -0 "$pid" 2>/dev/null && [[ $(ps -o stat= -p "$pid") != Z* ]]; then alive+=" $pid"; fi
      done
      [[ -z $alive ]] && break
      sleep 0.2
    done
    if [[ -n $alive ]]; then
      # shellcheck disable=SC2086  # a list of PIDs
      kill $alive 2>/dev/null || true
    fi
  fi
  if pid_alive "$D/munged.pid"; then
    pid=$(<"$D/munged.pid")
    kill "$pid"
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  fi
  rm -f "$D"/slurmctld.pid "$D"/slurmd-*.pid "$D/munged.pid"
  if [[ -s $D/netns.created ]]; then
    ip netns delete "$(<"$D/netns.created")" 2>/dev/null || true
    rm -f "$D/netns.created"
  fi
  echo "stopped"
}

do_status() {
  local f rc=0
  for f in "$D/munged.pid" "$D/slurmctld.pid" "$D"/slurmd-*.pid; do
    [[ -e $f ]] || continue
    if pid_alive "$f"; then
      echo "$(basename "$f" .pid): running (pid $(<"$f"))"
    else
      echo "$(basename "$f" .pid): dead"
      rc=1
    fi
  done
  if ! pid_alive "$D/slurmctld.pid"; then
    echo "slurmctld: not running"
    return 1
  fi
  echo "network namespace: ${NETNS:-none (host network)}"
  in_ns sinfo -N
  return "$rc"
}

do_run() {
  [[ $# -gt 0 ]] || die "run: give a command, e.g. '$0 run squeue'"
  in_ns "$@"
}

cmd=${1:-}
case $cmd in
  install | start | stop | status | run)
    shift
    "do_$cmd" "$@"
    ;;
  *)
    sed -n '2,16p' "$0" >&2
    exit 2
    ;;
esac
