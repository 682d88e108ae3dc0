#!/usr/bin/env bash
# Builds the Dockerfile's CPU variant without Docker or a registry, then runs examples/hello.py
# on 2 ranks inside it. Needs root and Debian's podman, buildah (podman's builder) and
# debootstrap:  apt-get install -y podman buildah debootstrap
#
#   scripts/build_cpu_image.sh     # 108-288 s on our 2-core box (docs/clusters.md); .ci/run runs it
#
# As root on Debian/Ubuntu it installs the three tools itself when they are missing (.ci/run).
#
# 1. debootstrap a minimal Debian bookworm from Debian's own package mirror (the base image);
# 2. podman import it as localhost/debian-bookworm-minbase;
# 3. podman build the Dockerfile on it: BASE_IMAGE=that image, EXTRA=tensorflow-cpu;
# 4. run mgpu-train -np 2 examples/hello.py in the image's file system with chroot: `podman run`
#    needs an OCI runtime with cgroup and rlimit rights that CI sandboxes may lack, `chroot` not.
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
  if [ -n "$mounted" ]; then
    umount "$mounted/tmp" "$mounted/sys" "$mounted/dev" "$mounted/proc" 2>/dev/null || true
    podman image unmount "$image" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

missing=()
for tool in podman buildah debootstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "scripts/build_cpu_image.sh: ${missing[*]} missing; as root on Debian/Ubuntu:" \
         "apt-get install -y podman buildah debootstrap" >&2
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
echo "=== the CPU image builds and runs ($((SECONDS - start)) s)"
