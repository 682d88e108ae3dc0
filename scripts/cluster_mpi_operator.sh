# shellcheck shell=bash
# The mpi-operator layout of scripts/cluster.sh (which sources this file): the pods Kubeflow's
# MPI Operator (v2beta1, as kubeflow/mpi-operator v0.8.2 writes them) makes for an MPIJob named
# mgpu-digits in namespace default with slotsPerWorker 2, sshAuthMountPath /home/mgpu/.ssh and
# the image of this repository's Dockerfile:
#
#   launcher   mgpu-digits-launcher  10.213.0.1  the launcher pod: a placeholder process holds
#              its namespaces (a pod's pause container); `exec` runs the job in it
#   worker-0   mgpu-digits-worker-0  10.213.0.2  worker pods: their only process is
#   worker-1   mgpu-digits-worker-1  10.213.0.3  `/usr/sbin/sshd -De -f /home/mgpu/.sshd_config`
#                                                as uid 10001 (docker/sshd_config)
#
# What each pod gets, as the operator, the kubelet and the image give it:
#   - its own /etc (an overlay on the host's; nothing written reaches the host): the image's
#     user mgpu (uid 10001, home /home/mgpu), the image's ssh client config
#     (docker/ssh_config: port 2222, no known_hosts), and /etc/hosts as the kubelet writes it
#     (the pod's own name on its address, not 127.0.1.1) plus what cluster DNS would answer:
#     every pod's <pod>.mgpu-digits.default.svc[.cluster.local], and on the workers the short
#     names too (the operator gives workers the search domain mgpu-digits.default.svc.cluster.local;
#     the launcher has none, so a short worker name does not resolve there);
#   - /home/mgpu, the image's home, private to the pod, with docker/sshd_config as .sshd_config;
#   - the job's ssh Secret read-only at /home/mgpu/.ssh: id_rsa (an ECDSA P-521 key in PEM, as
#     the operator generates), id_rsa.pub, authorized_keys (the same public key), owned by root
#     with mode 0644 (a Secret volume's default; the operator asks for 0600 only at /root/.ssh),
#     each a symlink into ..data/ as the kubelet lays a Secret out;
#   - the launcher only: the job's ConfigMap read-only at /etc/mpi, hostfile
#     ("<worker>.mgpu-digits.default.svc slots=2" per worker, mode 0444) and discover_hosts.sh
#     ("echo <worker>.mgpu-digits.default.svc" per running worker, bare names, mode 0555); a test
#     rewrites DIR/mpi/discover_hosts.sh as the operator does when a worker stops or starts;
#   - its own /tmp and /dev/shm (tmpfs), and DIR/shared at /mnt: a ReadWriteMany volume that
#     every pod mounts (where an elastic job keeps its backups);
#   - the container environment (DIR/env.<node>; `exec` starts from nothing else): the image's
#     ENV (HOME, PATH, PYTHONPATH, KERAS_BACKEND, PYTHONUNBUFFERED; this machine's Python and
#     checkout stand in for the image's /opt/venv, so `up`'s PATH and PYTHONPATH are used), and
#     on the launcher the operator's: K_MPI_JOB_ROLE, OMPI_MCA_orte_keep_fqdn_hostnames,
#     OMPI_MCA_orte_default_hostfile, OMPI_MCA_plm_rsh_args, OMPI_MCA_orte_set_default_slots and
#     the emptied NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES.
# This machine's Python and checkout must be readable by uid 10001: a directory on their path
# that it cannot enter (/root, mode 0700) is covered, in the pod only, by a tmpfs that holds just
# the entries on those paths (bind mounts of the real ones). MGPU_CLUSTER_EXPOSE (paths joined by
# ':', given to `up`) names more, e.g. the Python's prefix; the checkout is always included.
# MGPU_CLUSTER_ROOTFS (given to `up`): the file system of an image built from the Dockerfile
# (scripts/build_cpu_image.sh mounts its CPU variant): every pod then runs in a private overlay
# of it (chroot), with the image's own Python, sshd, configs and user, and the container
# environment is HOME, HOSTNAME, the lines of MGPU_CLUSTER_IMAGE_ENV (the image's ENV) and the
# operator's; nothing of the host's Python or checkout is used.
# Not simulated: Kubernetes itself (no API server, kubelet or operator process; the files are
# written once by `up` and by the test), a pod's PID namespace (the test sees the ranks' pids),
# cgroups and resource limits, GPUs.

OPERATOR_NODES=(launcher worker-0 worker-1)
OPERATOR_JOB=mgpu-digits
OPERATOR_NAMESPACE=default
OPERATOR_SLOTS=2
POD_UID=10001
POD_HOME=/home/mgpu

pod_name() {  # launcher -> mgpu-digits-launcher, worker-0 -> mgpu-digits-worker-0
  echo "$OPERATOR_JOB-$1"
}

pod_fqdn() {  # the name the operator writes in the hostfile and discover_hosts.sh
  echo "$(pod_name "$1").$OPERATOR_JOB.$OPERATOR_NAMESPACE.svc"
}

operator_discover_hosts() {  # DIR WORKER...: discover_hosts.sh listing those workers, as v0.8.2
  local dir=$1 worker
  shift
  {
    echo "#!/bin/sh"
    for worker in "$@"; do echo "echo $(pod_fqdn "$worker")"; done
  } > "$dir/mpi/.discover_hosts.sh.new"
  chmod 0555 "$dir/mpi/.discover_hosts.sh.new"
  mv -f "$dir/mpi/.discover_hosts.sh.new" "$dir/mpi/discover_hosts.sh"
}

operator_write_files() {
  local dir=$1 node other n stamp path fqdn
  rm -rf "$dir/secret" "$dir/mpi" "$dir/shared"
  # The Secret <job>-ssh, laid out as the kubelet mounts it.
  stamp=..2026_01_01_00_00_00.000000001
  mkdir -p "$dir/secret/$stamp"
  ssh-keygen -q -t ecdsa -b 521 -m PEM -N "" -C "" -f "$dir/secret/$stamp/id_rsa"
  cp "$dir/secret/$stamp/id_rsa.pub" "$dir/secret/$stamp/authorized_keys"
  chmod 0644 "$dir/secret/$stamp"/*
  ln -s "$stamp" "$dir/secret/..data"
  for path in id_rsa id_rsa.pub authorized_keys; do ln -s "..data/$path" "$dir/secret/$path"; done
  # The ConfigMap <job>-config.
  mkdir -p "$dir/mpi"
  for n in 0 1; do
    echo "$(pod_fqdn "worker-$n") slots=$OPERATOR_SLOTS"
  done > "$dir/mpi/hostfile"
  chmod 0444 "$dir/mpi/hostfile"
  operator_discover_hosts "$dir" worker-0 worker-1
  mkdir -p "$dir/shared"
  chown "$POD_UID:$POD_UID" "$dir/shared"
  for node in "${OPERATOR_NODES[@]}"; do
    {
      echo "# Kubernetes-managed hosts file."
      echo "127.0.0.1 localhost"
      echo "$SUBNET.$(node_number "$node") $(pod_fqdn "$node").cluster.local $(pod_name "$node")"
      echo "# cluster DNS"
      for other in "${OPERATOR_NODES[@]}"; do
        [ "$other" != "$node" ] || continue
        fqdn=$(pod_fqdn "$other")
        echo -n "$SUBNET.$(node_number "$other") $fqdn $fqdn.cluster.local"
        if [ "$node" != launcher ]; then echo " $(pod_name "$other")"; else echo; fi
      done
    } > "$dir/hosts.$node"
    {
      echo "HOME=$POD_HOME"
      echo "HOSTNAME=$(pod_name "$node")"
      if [ -n "${MGPU_CLUSTER_ROOTFS:-}" ]; then
        grep -v '^$' "${MGPU_CLUSTER_IMAGE_ENV:-/dev/null}" || true
      else
        echo "PATH=$PATH"
        echo "PYTHONPATH=${PYTHONPATH:-}"
        echo "KERAS_BACKEND=${KERAS_BACKEND:-tensorflow}"
        echo "PYTHONUNBUFFERED=1"
      fi
      if [ "$node" = launcher ]; then
        echo "K_MPI_JOB_ROLE=launcher"
        echo "OMPI_MCA_orte_keep_fqdn_hostnames=true"
        echo "OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile"
        echo "OMPI_MCA_plm_rsh_args=-o ConnectionAttempts=10"
        echo "OMPI_MCA_orte_set_default_slots=$OPERATOR_SLOTS"
        echo "NVIDIA_VISIBLE_DEVICES="
        echo "NVIDIA_DRIVER_CAPABILITIES="
      else
        echo "K_MPI_JOB_ROLE=worker"
      fi
    } > "$dir/env.$node"
  done
  { echo "$REPO"; tr ':' '\n' <<< "${MGPU_CLUSTER_EXPOSE:-}"; } | grep -v '^$' > "$dir/expose"
  if [ -n "${MGPU_CLUSTER_ROOTFS:-}" ]; then
    [ -x "$MGPU_CLUSTER_ROOTFS/usr/sbin/sshd" ] \
      || die "MGPU_CLUSTER_ROOTFS=$MGPU_CLUSTER_ROOTFS has no usr/sbin/sshd: expected the file" \
        "system of an image built from this repository's Dockerfile"
    echo "$MGPU_CLUSTER_ROOTFS" > "$dir/rootfs"
  else
    rm -f "$dir/rootfs"
  fi
}

pod_unreachable() {  # PATH...: "DIR ENTRY" for each path's first directory uid 10001 cannot enter
  setpriv --reuid="$POD_UID" --regid="$POD_UID" --clear-groups sh -c '
    for path; do
      at=/
      for part in $(echo "${path#/}" | tr / " "); do
        if [ ! -x "$at" ]; then echo "$at $part"; break; fi
        at=${at%/}/$part
      done
    done' sh "$@"
}

pod_expose() {  # DIR PATH...: make each path reachable for uid 10001 in this mount namespace
  local dir=$1 round blocked stage entry path p n=0
  shift
  for round in 1 2 3 4 5 6; do
    blocked=$(pod_unreachable "$@" | sort -u)
    [ -n "$blocked" ] || return 0
    for blocked in $(cut -d' ' -f1 <<< "$blocked" | sort -u); do
      case $dir/ in "$blocked"/*) die "cannot expose $blocked: it holds $dir" ;; esac
      n=$((n + 1))
      stage=$dir/expose.$n
      mkdir -p "$stage"
      mount --bind "$blocked" "$stage"
      mount -t tmpfs -o mode=0755 tmpfs "$blocked"
      for entry in $(for path; do
                       case $path in "$blocked"/*) p=${path#"$blocked"/}; echo "${p%%/*}" ;; esac
                     done | sort -u); do
        if [ -d "$stage/$entry" ]; then mkdir "$blocked/$entry"; else touch "$blocked/$entry"; fi
        mount --bind "$stage/$entry" "$blocked/$entry"
      done
    done
  done
  die "some of $* stay unreachable for uid $POD_UID"
}

pod_image_root() {  # DIR NODE ROOTFS ROOT: the pod's / at ROOT, a private overlay of the image
  local dir=$1 node=$2 rootfs=$3 root=$4
  mkdir -p "$root" "$dir/layer.$node"
  mount -t tmpfs tmpfs "$dir/layer.$node"
  mkdir "$dir/layer.$node/upper" "$dir/layer.$node/work"
  mount -t overlay overlay \
    -o "lowerdir=$rootfs,upperdir=$dir/layer.$node/upper,workdir=$dir/layer.$node/work" "$root"
  mount -t proc proc "$root/proc"
  mount --bind /dev "$root/dev"
  mount --bind -o ro /sys "$root/sys"  # Open MPI's UCX reads /sys/class/net
}

pod_host_root() {  # DIR NODE: the pod's / is the host's, with its own /etc and /home
  local dir=$1 node=$2
  mkdir -p "$dir/etc.$node"
  mount -t tmpfs tmpfs "$dir/etc.$node"
  mkdir "$dir/etc.$node/upper" "$dir/etc.$node/work"
  mount -t overlay overlay \
    -o "lowerdir=/etc,upperdir=$dir/etc.$node/upper,workdir=$dir/etc.$node/work" /etc
  # what the image's Dockerfile adds: its user, the ssh configs (docker/), the home
  echo "mgpu:x:$POD_UID:$POD_UID::$POD_HOME:/bin/bash" >> /etc/passwd
  echo "mgpu:x:$POD_UID:" >> /etc/group
  cp "$REPO/docker/ssh_config" /etc/ssh/ssh_config.d/mgpu-mpi-operator.conf
  mount -t tmpfs -o mode=0755 tmpfs /home
  mkdir -p "$POD_HOME"
  install -m 0644 "$REPO/docker/sshd_config" "$POD_HOME/.sshd_config"
  chown "$POD_UID:$POD_UID" "$POD_HOME" "$POD_HOME/.sshd_config"
}

operator_pod_init() {  # runs as the pod's first process, in its own UTS and mount namespaces
  local dir=$1 node=$2 paths env root="" run=()
  set -euo pipefail
  hostname "$(pod_name "$node")"
  if [ -f "$dir/rootfs" ]; then
    root=$dir/root.$node
    pod_image_root "$dir" "$node" "$(cat "$dir/rootfs")" "$root"
    run=(chroot "$root")
  else
    pod_host_root "$dir" "$node"
  fi
  cat "$dir/hosts.$node" > "$root/etc/hosts"
  if [ "$node" = launcher ]; then
    mkdir -p "$root/etc/mpi"
    mount --bind "$dir/mpi" "$root/etc/mpi"
    mount -o remount,bind,ro "$root/etc/mpi"
  fi
  mkdir -p "$root$POD_HOME/.ssh"
  mount --bind "$dir/secret" "$root$POD_HOME/.ssh"
  mount -o remount,bind,ro "$root$POD_HOME/.ssh"
  mount --bind "$dir/shared" "$root/mnt"
  if [ -z "$root" ]; then
    mapfile -t paths < "$dir/expose"
    pod_expose "$dir" "${paths[@]}"
  fi
  mapfile -t env < "$dir/env.$node"
  # Last: $dir may be under the host's /tmp.
  mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
  mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
  if [ "$node" = launcher ]; then
    exec "${run[@]}" env -i "${env[@]}" sleep infinity
  fi
  # setpriv from the image when there is one (chroot resolves the command inside it)
  exec "${run[@]}" setpriv --reuid="$POD_UID" --regid="$POD_UID" --clear-groups \
    env -i "${env[@]}" /usr/sbin/sshd -De -f "$POD_HOME/.sshd_config"
}

operator_exec() {  # as `kubectl exec`: the pod's user, its container environment, WORKDIR
  local dir=$1 node=$2 pid=$3 env root=()
  shift 3
  mapfile -t env < "$dir/env.$node"
  [ ! -f "$dir/rootfs" ] || root=(--root)  # the image's / (the pod's first process's)
  exec nsenter --target "$pid" --net --uts --mount "${root[@]}" -- setpriv --reuid="$POD_UID" \
    --regid="$POD_UID" --clear-groups env -i -C "$POD_HOME" "${env[@]}" "$@"
}

operator_reachable() {  # the launcher reaches every running worker's sshd, as mpirun will
  local dir=$1 node
  for node in "${OPERATOR_NODES[@]:1}"; do
    [ -f "$dir/$node.pid" ] || continue
    (operator_exec "$dir" launcher "$(node_pid "$dir" launcher)" \
       ssh -o BatchMode=yes -o ConnectTimeout=5 "$(pod_fqdn "$node")" true) 2>/dev/null || return 1
  done
}
