#!/usr/bin/env bash
# Network-namespace clusters on this one machine, for the multi-host tests (`pytest -m cluster`):
#
#   scripts/cluster.sh up DIR [LAYOUT]  build it; DIR (new or empty) holds its keys, configs, pids
#   scripts/cluster.sh exec DIR NODE COMMAND [ARGS...]   run a command "on" a node
#   scripts/cluster.sh pids DIR NODE    list every process on that node except its first one
#   scripts/cluster.sh stop DIR NODE    SIGKILL every process on that node (a host or pod lost)
#   scripts/cluster.sh start DIR NODE   start a stopped node again (a replacement pod)
#   scripts/cluster.sh down DIR         stop everything it started and delete its namespaces
#
# LAYOUT plain (the default): node1 and node2. Each node is a network namespace (its own eth0
# with 10.213.0.<n>/24 and lo) plus a UTS namespace (hostname node<n>) and a mount namespace in
# which
#   /etc/hosts           is the node's own file: "127.0.1.1 node<n>" for itself (Debian's
#                        default, the trap for code that resolves its own name) and the other
#                        node's veth address;
#   /etc/ssh/ssh_config.d holds a client config with a throwaway key made here,
# and whose first process is an sshd (Debian's openssh-server) on port 22 of the node's address
# that accepts only that key, for root. `exec` runs the command as root.
#
# LAYOUT mpi-operator: the pods of an MPIJob as Kubeflow's MPI Operator makes them, a launcher
# and two workers that run only a non-root sshd (scripts/cluster_mpi_operator.sh says what is
# simulated and how); `exec` runs the command as the pod's user with its container environment,
# as `kubectl exec` does.
#
# The nodes' veth pairs meet at a bridge inside a namespace of its own. Nothing of the host's
# network, /etc or /root is changed: the only addresses are inside namespaces made here, and the
# only host file created is sshd's empty privilege-separation directory /run/sshd (as the
# package's init script would).
#
# Needs root and scripts/install_cluster_deps.sh. `up` tears down what it built when any step
# fails or it is interrupted; every wait is bounded. Names: MGPU_CLUSTER_NAME (default mgpu<pid>)
# prefixes the namespaces, so two clusters can coexist.
set -euo pipefail

SUBNET=10.213.0
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
REPO=$(cd "$(dirname "$0")/.." && pwd)
NODES=()
LAYOUT=plain

die() { echo "scripts/cluster.sh: $*" >&2; exit 2; }
usage() {
  die "usage: scripts/cluster.sh up DIR [plain|mpi-operator] | down DIR |" \
      "exec DIR NODE COMMAND... | pids DIR NODE | stop DIR NODE | start DIR NODE"
}

# shellcheck source=scripts/cluster_mpi_operator.sh
. "$(dirname "$0")/cluster_mpi_operator.sh"

use_layout() {  # sets LAYOUT and NODES
  case $1 in
    plain) NODES=(node1 node2) ;;
    mpi-operator) NODES=("${OPERATOR_NODES[@]}") ;;
    *) die "unknown layout '$1' (expected plain or mpi-operator)" ;;
  esac
  LAYOUT=$1
}

load_layout() {  # the layout `up` recorded in DIR
  local dir=$1 layout=plain
  [ ! -f "$dir/layout" ] || layout=$(cat "$dir/layout")
  use_layout "$layout"
}

node_number() {
  local i
  for i in "${!NODES[@]}"; do
    if [ "${NODES[$i]}" = "$1" ]; then echo $((i + 1)); return 0; fi
  done
  die "unknown node '$1' (expected one of: ${NODES[*]})"
}

node_pid() {  # the node's first process (its sshd; a launcher pod's placeholder)
  local dir=$1 node=$2 pid
  [ -f "$dir/$node.pid" ] || die "$node is not running ($dir/$node.pid missing): run up" \
    "(or start, after stop) first"
  pid=$(cat "$dir/$node.pid")
  [ -d "/proc/$pid" ] || die "$node's first process (pid $pid) is gone: stop and start it, or" \
    "run down, then up again"
  echo "$pid"
}

kill_node() {  # SIGKILL every process in the node's network namespace (all of them are ours)
  local ns=$1 pid round left
  ip netns list 2>/dev/null | grep -qw "^$ns" || return 0
  for round in $(seq 50); do
    left=0
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      kill -KILL "$pid" 2>/dev/null || true
      left=1
    done
    [ $left -eq 0 ] && return 0
    sleep 0.1
  done
}

cmd_down() {
  local dir=$1 name ns node
  [ -f "$dir/name" ] || return 0
  name=$(cat "$dir/name")
  load_layout "$dir"
  # Every process in a node's network namespace is ours (sshd, its sessions, the ranks).
  for node in "${NODES[@]}"; do
    kill_node "$name-$node"
  done
  for ns in "${NODES[@]/#/$name-}" "$name-br"; do
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -f "$dir"/*.pid "$dir/name" "$dir/layout"
}

write_files() {  # the plain layout's keys and configs
  local dir=$1 n other
  rm -f "$dir"/id_ed25519* "$dir"/ssh_host_ed25519_key*  # a reused DIR: fresh throwaway keys
  ssh-keygen -q -t ed25519 -N "" -C "mgpu-cluster-throwaway" -f "$dir/id_ed25519"
  ssh-keygen -q -t ed25519 -N "" -C "mgpu-cluster-host" -f "$dir/ssh_host_ed25519_key"
  cp "$dir/id_ed25519.pub" "$dir/authorized_keys"
  mkdir -p "$dir/ssh_config.d"
  cat > "$dir/ssh_config.d/mgpu-cluster.conf" <<CONF
Host node1 node2 $SUBNET.*
  User root
  IdentityFile $dir/id_ed25519
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
  BatchMode yes
  ConnectTimeout 10
CONF
  for node in "${NODES[@]}"; do
    n=$(node_number "$node")
    {
      echo "127.0.0.1 localhost"
      echo "127.0.1.1 $node"
      for other in "${NODES[@]}"; do
        [ "$other" = "$node" ] || echo "$SUBNET.$(node_number "$other") $other"
      done
    } > "$dir/hosts.$node"
    cat > "$dir/sshd_config.$node" <<CONF
ListenAddress $SUBNET.$n
Port 22
HostKey $dir/ssh_host_ed25519_key
PidFile none
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile $dir/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
AcceptEnv LANG LC_*
Subsystem sftp internal-sftp
CONF
  done
}

start_node() {  # the node's first process, in new UTS and mount namespaces; its pid to DIR
  local dir=$1 node=$2 ns
  ns=$(cat "$dir/name")-$node
  # exec all the way down: the pid of this background job is the node's first process.
  if [ "$LAYOUT" = mpi-operator ]; then
    ip netns exec "$ns" unshare --uts --mount --propagation private \
      "$SELF" _pod-init "$dir" "$node" > "$dir/sshd.$node.log" 2>&1 < /dev/null &
  else
    ip netns exec "$ns" unshare --uts --mount --propagation private sh -c '
      hostname "$1"
      mount --bind "$2/hosts.$1" /etc/hosts
      mount --bind "$2/ssh_config.d" /etc/ssh/ssh_config.d
      exec /usr/sbin/sshd -D -e -f "$2/sshd_config.$1"' sh "$node" "$dir" \
      > "$dir/sshd.$node.log" 2>&1 < /dev/null &
  fi
  echo $! > "$dir/$node.pid"
}

reachable() {  # can each node (the launcher: each worker) ssh to the others by name?
  local dir=$1
  if [ "$LAYOUT" = mpi-operator ]; then
    operator_reachable "$dir"
  else
    (cmd_exec "$dir" node1 ssh node2 true) 2>/dev/null \
      && (cmd_exec "$dir" node2 ssh node1 true) 2>/dev/null
  fi
}

wait_reachable() {  # bounded: 100 x 0.2 s
  local dir=$1 round node
  for round in $(seq 100); do
    reachable "$dir" && return 0
    for node in "${NODES[@]}"; do
      [ ! -f "$dir/$node.pid" ] || [ -d "/proc/$(cat "$dir/$node.pid")" ] \
        || die "$node's first process died: $(tail -3 "$dir/sshd.$node.log")"
    done
    sleep 0.2
  done
  die "the nodes cannot ssh to each other after 20 s; logs: $dir/sshd.*.log"
}

cmd_up() {
  local dir=$1 name node n ns
  use_layout "${2:-plain}"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ "$(id -u)" -eq 0 ] || die "up needs root (network namespaces, sshd)"
  [ ! -f "$dir/name" ] || die "$dir already holds a cluster: run down first"
  [ -x /usr/sbin/sshd ] || [ -n "${MGPU_CLUSTER_ROOTFS:-}" ] \
    || die "no /usr/sbin/sshd: run scripts/install_cluster_deps.sh"
  name=${MGPU_CLUSTER_NAME:-mgpu$$}
  echo "$name" > "$dir/name"
  echo "$LAYOUT" > "$dir/layout"
  UP_DIR=$dir  # global: the traps run after this function's locals are gone
  trap 'cmd_down "$UP_DIR"; exit 130' INT TERM
  trap '[ $? -eq 0 ] || cmd_down "$UP_DIR"' EXIT
  if [ "$LAYOUT" = mpi-operator ]; then operator_write_files "$dir"; else write_files "$dir"; fi
  mkdir -p /run/sshd
  ip netns add "$name-br"
  ip -n "$name-br" link add br0 type bridge
  ip -n "$name-br" link set br0 up
  for node in "${NODES[@]}"; do
    n=$(node_number "$node")
    ns=$name-$node
    ip netns add "$ns"
    # Both ends are made inside our namespaces: the host's own interfaces are never touched.
    ip -n "$name-br" link add "v$n" type veth peer name eth0 netns "$ns"
    ip -n "$name-br" link set "v$n" master br0 up
    ip -n "$ns" addr add "$SUBNET.$n/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    start_node "$dir" "$node"
  done
  wait_reachable "$dir"
  echo -n "cluster $name ($LAYOUT) up in $dir:"
  for node in "${NODES[@]}"; do echo -n " $node=$SUBNET.$(node_number "$node")"; done
  echo
}

cmd_exec() {
  local dir=$1 node=$2
  shift 2
  [ $# -gt 0 ] || usage
  local pid
  load_layout "$dir"
  node_number "$node" > /dev/null
  pid=$(node_pid "$dir" "$node") || exit 2
  # exec: the caller's pid becomes the command's, so signals (Ctrl-C) reach it directly.
  if [ "$LAYOUT" = mpi-operator ]; then
    operator_exec "$dir" "$node" "$pid" "$@"
  fi
  exec nsenter --target "$pid" --net --uts --mount --wd="$PWD" -- "$@"
}

cmd_pids() {  # a stopped node: every process still in its network namespace
  local dir=$1 node=$2 first=""
  load_layout "$dir"
  node_number "$node" > /dev/null
  [ ! -f "$dir/$node.pid" ] || first=$(cat "$dir/$node.pid")
  ip netns pids "$(cat "$dir/name")-$node" | grep -vx "${first:-none}" || true
}

cmd_stop() {
  local dir=$1 node=$2
  load_layout "$dir"
  node_number "$node" > /dev/null
  [ -f "$dir/name" ] || die "$dir has no cluster: run up first"
  kill_node "$(cat "$dir/name")-$node"
  rm -f "$dir/$node.pid"
}

cmd_start() {
  local dir=$1 node=$2
  load_layout "$dir"
  node_number "$node" > /dev/null
  [ -f "$dir/name" ] || die "$dir has no cluster: run up first"
  [ ! -f "$dir/$node.pid" ] || die "$node is running: stop it first"
  [ -z "$(ip netns pids "$(cat "$dir/name")-$node")" ] || die "$node still has processes"
  start_node "$dir" "$node"
  wait_reachable "$dir"
}

[ $# -ge 2 ] || usage
command=$1
shift
case $command in
  up) [ $# -eq 1 ] || [ $# -eq 2 ] || usage; cmd_up "$@" ;;
  down) [ $# -eq 1 ] || usage; cmd_down "$1" ;;
  exec) [ $# -ge 3 ] || usage; cmd_exec "$@" ;;
  pids) [ $# -eq 2 ] || usage; cmd_pids "$@" ;;
  stop) [ $# -eq 2 ] || usage; cmd_stop "$@" ;;
  start) [ $# -eq 2 ] || usage; cmd_start "$@" ;;
  _pod-init) [ $# -eq 2 ] || usage; operator_pod_init "$@" ;;  # start_node's, inside the pod
  *) usage ;;
esac
