#!/usr/bin/env bash
# One Ray node of a slimish Slurm job. launch/train.sbatch runs it under srun, one task per node:
#
#   srun ... launch/ray_node.sh head LOG_DIR      # Ray head in the foreground until SIGTERM
#   srun ... launch/ray_node.sh worker LOG_DIR    # Ray worker joining $SLIMISH_RAY_HEAD_ADDRESS
#   launch/ray_node.sh address                    # print this node's IP:GCS_PORT (run on the head node)
#
# On SIGTERM (scancel, or train.sbatch's teardown signalling the step) it stops `ray start --block`, which shuts
# its Ray processes down, then kills whatever is left in that session and removes the node's Ray temp dir.
# `ray start` runs in a session of its own, so "ours" is exact: Ray's processes, its workers and their children
# (e.g. SGLang servers) all keep that session id unless they call setsid themselves. No pkill, no `ray stop`.
#
# Settings (environment; train.sbatch documents them too):
#   SLIMISH_RAY_PORT_BASE    first port of this job (default 20000). Head-only ports: BASE+0 GCS, +1 Ray client,
#                            +2 dashboard, +3 dashboard metrics, +4 autoscaler metrics. Node K (its index in the job's
#                            node list) uses BASE+10+10K .. +5 for raylet, object manager, metrics, agent gRPC and HTTP,
#                            runtime-env agent, and worker ports 10000+1000*(K%10) .. +999. Per-node ports keep
#                            simulated nodes that share one host apart; on a real cluster they are merely distinct.
#   RAY_AUTH_MODE, RAY_AUTH_TOKEN  set by train.sbatch (one token per job), inherited by every Ray process
#   SLIMISH_NET_IFNAME       interface whose IPv4 address Ray uses (default: the address the hostname resolves to)
#   SLIMISH_RAY_NUM_CPUS     CPUs Ray offers per node (default SLURM_CPUS_ON_NODE, else Ray's own count)
#   SLIMISH_RAY_NUM_GPUS     GPUs Ray offers per node (default SLURM_GPUS_ON_NODE, else 0)
#   SLIMISH_RAY_DASHBOARD    1 = start the Ray dashboard on the head (default 0)
#   SLIMISH_RAY_TMPDIR       parent of the per-node Ray temp dir (default /tmp; keep it short: socket paths)
#   SLIMISH_RAY_START_ARGS   extra arguments for every `ray start`
#   SLIMISH_EXEC             command prefix `ray start` runs under (a container runtime; see launch/train.sbatch)
#   SLIMISH_KEEP_RAY_TMP     1 = keep the Ray temp dir (session logs) after the node stops
#   SLIMISH_TEARDOWN_TIMEOUT seconds to wait for Ray to stop before SIGKILL (default 15)
#
# Keeping a multi-node Ray on loopback (all nodes on one host, as with launch/local_slurm.sh); Ray 2.60, measured:
#  - default: Ray treats --node-ip-address=127.0.0.1 (and --address=127.0.0.1:P) as "localhost" and swaps in the
#    host's outward address; the GCS, raylet and agent gRPC servers then bind *, metrics 0.0.0.0.
#  - RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: everything stays on 127.0.0.1, but `ray start --address` refuses to join.
#  - --node-ip-address=127.0.0.2 is kept as is, but the gRPC servers bind * (Ray binds 127.0.0.1 only when the node
#    address is exactly 127.0.0.1).
#  - what works, with plain `ray start` on every node: run the nodes in a network namespace whose only interface is
#    loopback (local_slurm.sh does). Ray finds no outward address, keeps 127.0.0.1, and every Ray listener binds
#    127.0.0.1: `ray start --head --node-ip-address=127.0.0.1 --port=P ...` and
#    `ray start --address=127.0.0.1:P --node-ip-address=127.0.0.1 ...`, each node on its own ports (see above).
# Token auth must be explicit (train.sbatch sets it): otherwise the head turns it on only if ~/.ray/auth_token
# exists, and a joining worker, which does not, is refused ("InvalidAuthToken").
set -euo pipefail

BASE=${SLIMISH_RAY_PORT_BASE:-20000}
# What the job's actors write (checkpoints, engine logs, weight-sync shards in the run directory) is the user's only.
umask 077
# slimish sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in a process that runs a local Ray (see above); a job submitted
# from such a process inherits it through sbatch's environment export, and a worker would then refuse to join.
unset RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER

log() { echo "[ray_node $(date +%T)] $*"; }

node_ip() {
  local ip
  if [[ -n ${SLIMISH_NET_IFNAME:-} ]]; then
    ip=$(ip -4 -o addr show dev "$SLIMISH_NET_IFNAME" | awk '{split($4, a, "/"); print a[1]; exit}')
  else
    ip=$(hostname --ip-address | awk '{print $1}')
  fi
  [[ -n $ip ]] || { echo "ray_node: cannot determine this node's IP address" >&2; return 1; }
  if [[ $ip == 127.* && $ip != 127.0.0.1 ]]; then
    echo "ray_node: warning: the hostname resolves to $ip; other nodes cannot reach that: set SLIMISH_NET_IFNAME" >&2
  fi
  echo "$ip"
}

# Index of node $1 in the job's node list. (SLURM_NODEID counts within the step: 0 on the first worker too.)
node_index() {
  scontrol show hostnames "${SLURM_JOB_NODELIST:-$1}" | awk -v n="$1" '$1 == n {print NR - 1; found = 1; exit}
    END {if (!found) print 0}'
}

# PIDs of live processes in session $1.
session_pids() {
  ps -e -o pid=,sid=,stat= | awk -v s="$1" '$2 == s && $3 !~ /^Z/ {print $1}'
}

alive() { kill -0 "$1" 2>/dev/null && [[ $(ps -o stat= -p "$1" 2>/dev/null) != Z* ]]; }

start_node() {
  local role=$1 log_dir=$2
  local node=${SLURMD_NODENAME:-$(hostname -s)}
  local timeout=${SLIMISH_TEARDOWN_TIMEOUT:-15}
  local index ip port wport tmp cpus gpus rc=0 leftovers marker
  local -a args extra
  exec >>"$log_dir/ray-$node.log" 2>&1

  index=$(node_index "$node")
  ip=$(node_ip)
  port=$((BASE + 10 + 10 * index))
  wport=$((10000 + (index % 10) * 1000))
  # Unique even when two simulated clusters on one host hand out the same job id.
  tmp=$(mktemp -d "${SLIMISH_RAY_TMPDIR:-/tmp}/slimish-ray-${SLURM_JOB_ID:-0}-$index-XXXX")
  cpus=${SLIMISH_RAY_NUM_CPUS:-${SLURM_CPUS_ON_NODE:-}}
  gpus=${SLIMISH_RAY_NUM_GPUS:-${SLURM_GPUS_ON_NODE:-0}}
  args=(--node-ip-address="$ip" --node-name="$node" --num-gpus="$gpus"
    --node-manager-port="$port" --object-manager-port=$((port + 1)) --metrics-export-port=$((port + 2))
    --dashboard-agent-grpc-port=$((port + 3)) --dashboard-agent-listen-port=$((port + 4))
    --runtime-env-agent-port=$((port + 5)) --min-worker-port="$wport" --max-worker-port=$((wport + 999))
    --temp-dir="$tmp" --disable-usage-stats --block)
  [[ -n $cpus ]] && args+=(--num-cpus="$cpus")
  case $role in
    head)
      # Head-only services that would otherwise take fixed default ports.
      export DASHBOARD_METRIC_PORT=$((BASE + 3)) AUTOSCALER_METRIC_PORT=$((BASE + 4))
      args+=(--head --port="$BASE" --ray-client-server-port=$((BASE + 1)) --dashboard-host="$ip"
        --dashboard-port=$((BASE + 2)))
      if [[ ${SLIMISH_RAY_DASHBOARD:-0} == 1 ]]; then args+=(--include-dashboard=true); else args+=(--include-dashboard=false); fi
      ;;
    worker)
      [[ -n ${SLIMISH_RAY_HEAD_ADDRESS:-} ]] || { log "SLIMISH_RAY_HEAD_ADDRESS is not set"; return 2; }
      args+=(--address="$SLIMISH_RAY_HEAD_ADDRESS")
      ;;
    *)
      log "unknown role '$role' (head or worker)"
      return 2
      ;;
  esac
  read -ra extra <<<"${SLIMISH_RAY_START_ARGS:-}"
  # Nothing needs draining at teardown: the driver is gone (or going) and its work with it.
  export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}

  marker="node=$node role=$role index=$index step=${SLURM_JOB_ID:-}.${SLURM_STEP_ID:-} host=$(hostname)"
  marker+=" ip=$ip cpus=${cpus:-auto} gpus=$gpus"
  echo "$(date +%FT%T) $marker" >>"$log_dir/nodes.log"
  log "starting: $marker"

  # A trapped signal interrupts `wait` below; the shutdown itself happens after it.
  ray_pid="" stopping=0
  trap 'stop_ray TERM' TERM
  trap 'stop_ray INT' INT
  trap 'stop_ray HUP' HUP
  read -ra exec_prefix <<<"${SLIMISH_EXEC:-}"
  setsid "${exec_prefix[@]}" ray start "${args[@]}" "${extra[@]}" &
  ray_pid=$!
  echo "$ray_pid" >"$log_dir/ray-$node.pid"
  wait "$ray_pid" || rc=$?

  local deadline=$((SECONDS + timeout))
  while alive "$ray_pid" && [[ $SECONDS -lt $deadline ]]; do sleep 0.2; done
  if alive "$ray_pid"; then
    log "ray start (pid $ray_pid) still running after ${timeout}s: SIGKILL"
    kill -KILL "$ray_pid" 2>/dev/null || true
  fi
  # Ray workers sit in process groups of their own, but all stay in ray start's session.
  leftovers=$(session_pids "$ray_pid")
  if [[ -n $leftovers ]]; then
    log "killing leftovers of session $ray_pid: $(echo "$leftovers" | tr '\n' ' ')"
    # shellcheck disable=SC2086  # a list of PIDs
    kill -KILL $leftovers 2>/dev/null || true
  fi
  [[ ${SLIMISH_KEEP_RAY_TMP:-0} == 1 ]] || rm -rf "$tmp"
  log "stopped (ray start exit code $rc)"
  # Stopping on request is a success; Ray dying by itself is not.
  if [[ $stopping == 1 ]]; then return 0; fi
  return "$rc"
}

stop_ray() {
  log "got SIG$1: stopping Ray"
  stopping=1
  if [[ -n $ray_pid ]]; then kill -TERM "$ray_pid" 2>/dev/null || true; fi
}

case ${1:-} in
  head | worker)
    [[ $# == 2 ]] || { echo "usage: $0 head|worker LOG_DIR" >&2; exit 2; }
    start_node "$1" "$2"
    ;;
  address)
    echo "$(node_ip):$BASE"
    ;;
  *)
    sed -n '2,7p' "$0" >&2
    exit 2
    ;;
esac
