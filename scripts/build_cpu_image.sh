#!/usr/bin/env bash
# Builds the Dockerfile's CPU variant without Docker or a registry, then runs examples/hello.py
# on 2 ranks inside it, and on 4 ranks across the image's two Kubernetes roles. Needs root and
# Debian's podman, buildah (podman's builder), debootstrap, iproute2 and openssh-client:
#   apt-get install -y podman buildah debootstrap iproute2 openssh-client
#
#   scripts/build_cpu_image.sh     # 108-288 s on our 2-core box (docs/clusters.md); .ci/run runs it
#
# As root on Debian/Ubuntu it installs the tools itself when they are missing (.ci/run).
#
# 1. debootstrap a minimal Debian bookworm from Debian's own package mirror (the base image);
# 2. podman import it as localhost/debian-bookworm-minbase;
# 3. podman build the Dockerfile on it: BASE_IMAGE=that image, EXTRA=tensorflow-cpu;
# 4. run mgpu-train -np 2 examples/hello.py in the image's file system with chroot: `podman run`
#    needs an OCI runtime with cgroup and rlimit rights that CI sandboxes may lack, `chroot` not;
# 5. play an MPI Operator MPIJob with the image (scripts/cluster.sh up DIR mpi-operator, every
#    pod a private overlay of the image's file system in its own namespaces): two worker pods
#    run only the image's `sshd -De -f /home/mgpu/.sshd_config` as uid 10001 with the
#    operator's key layout, and the launcher pod, with only the image's and the operator's
#    environment, reaches them over ssh and runs mgpu-train -np 4 examples/hello.py across them
#    (MGPU_ENGINE=none: MPI only, a few seconds; step 4 ran TensorFlow).
# Build-time RUN steps use --isolation=chroot for the same reason. The host's CA bundle is
# mounted into the build for pip (not copied into the image): a TLS-intercepting proxy's CA
# reaches pip that way. MIRROR and IMAGE override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
mirror=${MIRROR:-http://deb.debian.org/debian}
image=${IMAGE:-localhost/mgpu-launch:cpu}
work=$(mktemp -d)
mounted=""
cleanup() {
  if [ -f "$work/pods/name" ]; then
    scripts/cluster.sh down "$work/pods" || true
  fi
  if [ -n "$mounted" ]; then
    umount "$mounted/tmp" "$mounted/sys" "$mounted/dev" "$mounted/proc" 2>/dev/null || true
    podman image unmount "$image" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

missing=()
for tool in podman:podman buildah:buildah debootstrap:debootstrap ip:iproute2 \
    ssh-keygen:openssh-client; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "scripts/build_cpu_image.sh: ${missing[*]} missing; as root on Debian/Ubuntu:" \
         "apt-get install -y podman buildah debootstrap iproute2 openssh-client" >&2
    exit 2
  fi
  echo "=== apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
start=$SECONDS

echo "=== debootstrap bookworm from $mirror"
debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" \
  || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
tar -C "$work/rootfs" -c . | podman import - localhost/debian-bookworm-minbase >/dev/null

echo "=== podman build (BASE_IMAGE=localhost/debian-bookworm-minbase, EXTRA=tensorflow-cpu)"
volumes=()
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  # Beside the image's own bundle, not over it: the image's ca-certificates package writes its own.
  printf '[global]\ncert = /run/host-ca.crt\n' >"$work/pip.conf"
  volumes+=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro -v "$work/pip.conf:/etc/pip.conf:ro")
fi
podman build --isolation=chroot --network=host "${volumes[@]}" \
  --build-arg BASE_IMAGE=localhost/debian-bookworm-minbase --build-arg EXTRA=tensorflow-cpu \
  -t "$image" .

echo "=== mgpu-train -np 2 examples/hello.py in the image"
mounted=$(podman image mount "$image")
mount -t proc proc "$mounted/proc"
mount --bind /dev "$mounted/dev"
mount --bind -o ro /sys "$mounted/sys"  # Open MPI's UCX reads /sys/class/net
mount -t tmpfs tmpfs "$mounted/tmp"
# MGPU_TF_HOST: a bare chroot has no /etc/hosts entry for this host's name (a container has).
chroot --userspec=10001:10001 "$mounted" /usr/bin/env -i HOME=/home/mgpu \
  PATH=/opt/venv/bin:/usr/bin:/bin KERAS_BACKEND=tensorflow MGPU_TF_HOST=127.0.0.1 \
  mgpu-train -np 2 /opt/mgpu-launch/examples/hello.py | tee "$work/hello.log"
grep -q "sum of (rank + 1) over 2 ranks = 3" "$work/hello.log"

echo "=== the image's MPI Operator roles: 2 worker pods running only its sshd, a launcher pod"
pods_start=$SECONDS
podman image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$image" \
  >"$work/image.env"
MGPU_CLUSTER_NAME=mgpuimg$$ MGPU_CLUSTER_ROOTFS=$mounted MGPU_CLUSTER_IMAGE_ENV=$work/image.env \
  scripts/cluster.sh up "$work/pods" mpi-operator
scripts/cluster.sh exec "$work/pods" launcher env MGPU_ENGINE=none \
  mgpu-train -np 4 /opt/mgpu-launch/examples/hello.py 2>&1 | tee "$work/pods.log"
grep -q "sum of (rank + 1) over 4 ranks = 10" "$work/pods.log"
for round in $(seq 50); do  # nothing of the job is left in any pod (bounded: 10 s)
  left=$(for pod in launcher worker-0 worker-1; do
           scripts/cluster.sh pids "$work/pods" "$pod"
         done)
  [ -n "$left" ] || break
  sleep 0.2
done
if [ -n "$left" ]; then
  echo "scripts/build_cpu_image.sh: processes left in the pods:" >&2
  ps -o pid,user,args -p "$(echo $left | tr ' ' ,)" >&2
  exit 1
fi
scripts/cluster.sh down "$work/pods"
echo "=== (the MPI Operator roles: $((SECONDS - pods_start)) s)"
echo "=== the CPU image builds and runs ($((SECONDS - start)) s)"
