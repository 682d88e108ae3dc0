# mgpu-launch with GPU TensorFlow, `mgpu-train` as the entry point.
#
# The CUDA variant has not been built (the project's machines have no Docker engine); CI builds
# and runs the CPU variant with podman (scripts/build_cpu_image.sh), also in its two MPI
# Operator roles (worker pods running only its sshd, a launcher reaching them). Its install step is
# scripts/install.sh, the same script scripts/test.sh (CI) installs with, with the `tensorflow`
# extra instead of `tensorflow-cpu`. TensorFlow on GPUs itself has run, outside an image: on one
# and two H100s through NCCL (benchmarks/tf_gpu/README.md; README, "Status").
#
#   docker build -t mgpu-launch .
#   docker run --rm --gpus all --ipc=host mgpu-launch -np 2 \
#       /opt/mgpu-launch/examples/keras_resnet50_synthetic.py --batch-size 64
#
# --ipc=host (or a large --shm-size): Open MPI and NCCL pass data between the processes of one
# host through shared memory, and Docker's default /dev/shm is 64 MB.

# BASE_IMAGE: by default CUDA 12 runtime libraries, cuDNN 9 and NCCL, as TensorFlow 2.21's GPU
# build expects (CUDA >= 12.5, < 13; cuDNN >= 9.3); Ubuntu 24.04 brings Python 3.12. Any
# Debian/Ubuntu image with python3 >= 3.10 in its apt sources works, e.g. a CPU-only image:
#   docker build --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg EXTRA=tensorflow-cpu .
# EXTRA: the package extra scripts/install.sh installs (tensorflow, tensorflow-cpu, jax, torch);
# KERAS_BACKEND: the backend the image runs (tensorflow, jax or torch, to match EXTRA).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
FROM ${BASE_IMAGE}
ARG EXTRA=tensorflow
ARG KERAS_BACKEND=tensorflow

# PIP_NO_CACHE_DIR keeps pip's download cache out of the layer (scripts/install.sh stays as CI
# runs it). openssh-client: mpirun starts ranks on other hosts over ssh; openssh-server: the
# worker role (below).
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    KERAS_BACKEND=${KERAS_BACKEND}

# Not root (the user is created here, in the same layer): Open MPI refuses root without
# --allow-run-as-root, and a container needs no root. A numeric id above the images' own users
# (Ubuntu 24.04 has uid 1000) so `USER` resolves without the image's /etc/passwd.
# Versions are not pinned: they come from whichever BASE_IMAGE's apt sources.
#
# Two roles, one image (examples/kubernetes/, Kubeflow's MPI Operator): the launcher runs
# mgpu-train; a worker runs only `/usr/sbin/sshd -De -f /home/mgpu/.sshd_config` as this user,
# on port 2222 (a non-root sshd cannot bind 22). The operator mounts the job's key pair
# (id_rsa, id_rsa.pub, authorized_keys) at the MPIJob's sshAuthMountPath, /home/mgpu/.ssh.
# docker/sshd_config and docker/ssh_config say why each setting is there; the cluster tests run
# both files (tests/test_cluster_mpi_operator.py).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv openssh-client \
        openssh-server \
 && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*_key* \
 && mkdir -p /run/sshd \
 && python3 -m venv /opt/venv \
 && useradd --create-home --uid 10001 --shell /bin/bash mgpu
COPY docker/ssh_config /etc/ssh/ssh_config.d/mgpu-mpi-operator.conf
COPY --chown=10001:10001 docker/sshd_config /home/mgpu/.sshd_config

# Only what the package needs (and the examples), so edits elsewhere keep the cache.
WORKDIR /opt/mgpu-launch
COPY pyproject.toml setup.py README.md ./
COPY scripts/install.sh scripts/
COPY mgpu_launcher/ mgpu_launcher/
COPY mgpu_launch/ mgpu_launch/
COPY examples/ examples/
RUN PYTHON=/opt/venv/bin/python scripts/install.sh "${EXTRA}"

USER 10001
WORKDIR /home/mgpu

ENTRYPOINT ["mgpu-train"]
CMD ["--help"]
