#!/usr/bin/env bash
# Installs the system packages the cluster tests need (`pytest -m cluster`, .ci/run): Debian's
# openssh-server (one sshd per namespace "node", scripts/cluster.sh) and Slurm + munge
# (scripts/slurm.sh). Root, Debian/Ubuntu (apt). Nothing is started or enabled here: the
# scripts start their own daemons with their own configuration, and stop them again.
#
#   scripts/install_cluster_deps.sh
set -euo pipefail
packages=(openssh-server iproute2 procps slurmctld slurmd slurm-client munge libpmix2 libpmix-dev)
if [ "$(id -u)" -ne 0 ]; then
  echo "scripts/install_cluster_deps.sh: must run as root (it installs with apt-get)" >&2
  exit 2
fi
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" \
    || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
# A package's maintainer scripts must not start its service system-wide (sshd on the host's
# port 22, a default slurmctld): policy-rc.d says no, as in Docker images. Ours only if absent.
own_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  own_policy=/usr/sbin/policy-rc.d
  printf '#!/bin/sh\nexit 101\n' > "$own_policy"
  chmod +x "$own_policy"
  trap 'rm -f "$own_policy"' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
