#!/usr/bin/env bash
# A 2-node cluster on this one machine, for the multi-host tests (`pytest -m cluster`):
#
#   scripts/cluster.sh up DIR        build it; DIR (new or empty) holds its keys, configs, pids
#   scripts/cluster.sh exec DIR NODE COMMAND [ARGS...]   run a command "on" node1 or node2
#   scripts/cluster.sh pids DIR NODE list every process on that node except its sshd
#   scripts/cluster.sh down DIR      stop everything it started and delete its namespaces
#
# Each node is a network namespace (its own eth0 with 10.213.0.<n>/24 and lo) plus a UTS
# namespace (hostname node<n>) and a mount namespace in which
#   /etc/hosts           is the node's own file: "127.0.1.1 node<n>" for itself (Debian's
#                        default, the trap for code that resolves its own name) and the other
#                        node's veth address;
#   /etc/ssh/ssh_config.d holds a client config with a throwaway key made here,
# and whose first process is an sshd (Debian's openssh-server) on port 22 of the node's address
# that accepts only that key, for root. The nodes' veth pairs meet at a bridge inside a
# namespace of its own. Nothing of the host's network, /etc or /root is changed: the only
# addresses are inside namespaces made here, and the only host file created is sshd's empty
# privilege-separation directory /run/sshd (as the package's init script would).
#
# Needs root and scripts/install_cluster_deps.sh. `up` tears down what it built when any step
# fails or it is interrupted; every wait is bounded. Names: MGPU_CLUSTER_NAME (default mgpu<pid>)
# prefixes the namespaces, so two clusters can coexist.
set -euo pipefail

NODES=(node1 node2)
SUBNET=10.213.0

die() { echo "scripts/cluster.sh: $*" >&2; exit 2; }
usage() {
  die "usage: scripts/cluster.sh up DIR | down DIR | exec DIR NODE COMMAND... | pids DIR NODE"
}

node_number() {
  case $1 in node1) echo 1 ;; node2) echo 2 ;;
    *) die "unknown node '$1' (expected one of: ${NODES[*]})" ;; esac
}

node_pid() {  # the sshd that is the node's first process
  local dir=$1 node=$2 pid
  [ -f "$dir/$node.pid" ] || die "$dir has no running cluster ($dir/$node.pid missing): run up first"
  pid=$(cat "$dir/$node.pid")
  [ -d "/proc/$pid" ] || die "$node's sshd (pid $pid) is gone: run down, then up again"
  echo "$pid"
}

cmd_down() {
  local dir=$1 name ns pid round
  [ -f "$dir/name" ] || return 0
  name=$(cat "$dir/name")
  # Every process in a node's network namespace is ours (sshd, its sessions, the ranks).
  for round in 1 2 3 4 5 6 7 8 9 10; do
    local left=0
    for node in "${NODES[@]}"; do
      ns=$name-$node
      ip netns list 2>/dev/null | grep -qw "^$ns" || continue
      for pid in $(ip netns pids "$ns" 2>/dev/null); do
        kill -KILL "$pid" 2>/dev/null || true
        left=1
      done
    done
    [ $left -eq 0 ] && break
    sleep 0.2
  done
  for ns in "${NODES[@]/#/$name-}" "$name-br"; do
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -f "$dir"/*.pid "$dir/name"
}

write_files() {
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

cmd_up() {
  local dir=$1 name node n ns pid round
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  [ "$(id -u)" -eq 0 ] || die "up needs root (network namespaces, sshd)"
  [ ! -f "$dir/name" ] || die "$dir already holds a cluster: run down first"
  [ -x /usr/sbin/sshd ] || die "no /usr/sbin/sshd: run scripts/install_cluster_deps.sh"
  name=${MGPU_CLUSTER_NAME:-mgpu$$}
  echo "$name" > "$dir/name"
  UP_DIR=$dir  # global: the traps run after this function's locals are gone
  trap 'cmd_down "$UP_DIR"; exit 130' INT TERM
  trap '[ $? -eq 0 ] || cmd_down "$UP_DIR"' EXIT
  write_files "$dir"
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
    # exec all the way down: the pid of this background job is the node's sshd.
    ip netns exec "$ns" unshare --uts --mount --propagation private sh -c '
      hostname "$1"
      mount --bind "$2/hosts.$1" /etc/hosts
      mount --bind "$2/ssh_config.d" /etc/ssh/ssh_config.d
      exec /usr/sbin/sshd -D -e -f "$2/sshd_config.$1"' sh "$node" "$dir" \
      > "$dir/sshd.$node.log" 2>&1 < /dev/null &
    echo $! > "$dir/$node.pid"
  done
  # Ready when each node reaches the other over ssh by name (bounded: 100 x 0.2 s).
  for round in $(seq 100); do
    if (cmd_exec "$dir" node1 ssh node2 true) 2>/dev/null \
        && (cmd_exec "$dir" node2 ssh node1 true) 2>/dev/null; then
      echo "cluster $name up in $dir: node1=$SUBNET.1 node2=$SUBNET.2"
      return 0
    fi
    for node in "${NODES[@]}"; do
      [ -d "/proc/$(cat "$dir/$node.pid")" ] \
        || die "$node's sshd died: $(tail -3 "$dir/sshd.$node.log")"
    done
    sleep 0.2
  done
  die "the nodes cannot ssh to each other after 20 s; sshd logs: $dir/sshd.node*.log"
}

cmd_exec() {
  local dir=$1 node=$2
  shift 2
  [ $# -gt 0 ] || usage
  local pid
  node_number "$node" > /dev/null
  pid=$(node_pid "$dir" "$node") || exit 2
  # exec: the caller's pid becomes the command's, so signals (Ctrl-C) reach it directly.
  exec nsenter --target "$pid" --net --uts --mount --wd="$PWD" -- "$@"
}

cmd_pids() {
  local dir=$1 node=$2 sshd
  sshd=$(node_pid "$dir" "$node") || exit 2
  ip netns pids "$(cat "$dir/name")-$node" | grep -vx "$sshd" || true
}

[ $# -ge 2 ] || usage
command=$1
shift
case $command in
  up) [ $# -eq 1 ] || usage; cmd_up "$1" ;;
  down) [ $# -eq 1 ] || usage; cmd_down "$1" ;;
  exec) [ $# -ge 3 ] || usage; cmd_exec "$@" ;;
  pids) [ $# -eq 2 ] || usage; cmd_pids "$@" ;;
  *) usage ;;
esac
