"""An MPIJob of Kubeflow's MPI Operator, played on one box (scripts/cluster.sh up DIR mpi-operator).

The launcher pod and two worker pods are network + UTS + mount namespaces set up as the operator
(v2beta1, kubeflow/mpi-operator v0.8.2), the kubelet and this repository's Dockerfile would set
up the pods (scripts/cluster_mpi_operator.sh lists what is simulated and what is not): the
workers run only ``sshd -De -f /home/mgpu/.sshd_config`` as uid 10001 with the job's key at
/home/mgpu/.ssh, and mgpu-train runs in the launcher as uid 10001 with nothing but the image's and
the operator's environment: the hostfile reaches it only through
``OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile``, the slots of the discovery script's bare
names only through ``OMPI_MCA_orte_set_default_slots``. The commands are the launcher commands
of examples/kubernetes/ with the digits data instead of ResNet-50 and 2 slots per worker.

The elastic test deletes worker-1's pod mid-training (every process in it SIGKILLed, sshd and
prted included), rewrites discover_hosts.sh without it as the operator would, then starts its
replacement and lists it again: the job goes on in worker-0 and grows back to both pods.

Marked ``cluster`` (root, network namespaces, overlayfs, openssh-server); TensorFlow.
"""

import collections
import json
import os
import re
import subprocess

import pytest

import elastickit
from conftest import ROOT, SCRIPTS, explain
from test_cluster_elastic import BATCH, DIGITS, ELASTIC, FORWARD, RESIZE

pytestmark = [pytest.mark.cluster, pytest.mark.job]

REPORT = os.path.join(SCRIPTS, "report.py")
TRAIN = os.path.join(ROOT, "examples", "keras_digits.py")
#: mgpu-train's first line: the operator's hostfile, found through the operator's variable
HOSTS = ("mgpu-train: hosts: /etc/mpi/hostfile (from $OMPI_MCA_orte_default_hostfile): 2 hosts; "
         "4 slots -> mpirun --hostfile /etc/mpi/hostfile")


def test_the_launcher_places_two_ranks_in_each_worker_pod(mpi_operator_cluster):
    here, there = mpi_operator_cluster.volume_folder("report")
    result = mpi_operator_cluster.mgpu_train("-np", "4", REPORT, there, MGPU_ENGINE="none")
    assert result.returncode == 0, explain(result)
    placed = {}
    for rank in range(4):
        report = json.loads((here / f"rank.{rank}.json").read_text())
        placed[rank] = (report["host"], report["local_rank"], report["cross_rank"])
        assert report["average"] == 2.5  # (1 + 2 + 3 + 4) / 4 over MPI, across the pods
    assert placed == {0: ("mgpu-digits-worker-0", 0, 0), 1: ("mgpu-digits-worker-0", 1, 0),
                      2: ("mgpu-digits-worker-1", 0, 1), 3: ("mgpu-digits-worker-1", 1, 1)}
    assert HOSTS in result.stderr, explain(result)
    assert not mpi_operator_cluster.wait_until_empty(15), "processes left behind"


def test_the_digits_example_trains_on_two_worker_pods_with_the_operators_environment_only(
        mpi_operator_cluster):
    pods = mpi_operator_cluster
    # examples/kubernetes/mpijob-resnet50.yaml's launcher command, with the digits example
    result = pods.mgpu_train("-np", "4", TRAIN, "--epochs", "1", timeout=400)
    assert result.returncode == 0, explain(result)
    assert re.search(r"final validation accuracy: 0\.\d+ \(4 processes, 1 epochs", result.stdout), \
        explain(result)
    # rank 0 ran in worker-0's pod: the checkpoint is in that pod's home (the working
    # directory, /home/mgpu, as in the image), not the launcher's
    assert pods.pod_path("worker-0", "/home/mgpu/checkpoints/digits.keras").is_file()
    assert not pods.pod_path("launcher", "/home/mgpu/checkpoints").exists()
    assert not pods.wait_until_empty(15), "processes left behind"


def test_an_elastic_mpijob_goes_on_without_a_deleted_worker_pod_and_grows_back(
        mpi_operator_cluster):
    pods = mpi_operator_cluster
    here, there = pods.volume_folder("elastic")  # the backups must be on a shared volume
    samples = 640  # 10 steps an epoch on 4 processes, 20 on 2
    # examples/kubernetes/mpijob-resnet50-elastic.yaml's launcher command, 2 workers x 2 slots
    proc = pods.start_mgpu_train(
        "-np", "4", "--min-np", "2", "--max-np", "4",
        "--host-discovery-script", "/etc/mpi/discover_hosts.sh", "--elastic-timeout", "900",
        *FORWARD, RESIZE, f"{there}/backup", there,
        **{**DIGITS, "RESIZE_SAMPLES": str(samples), "RESIZE_EPOCHS": "3"}, **ELASTIC,
        MGPU_BLACKLIST_COOLDOWN="2")
    try:
        with elastickit.reaped(proc):
            elastickit.wait_for_steps(here, 0, 5, proc)
            pods.stop("worker-1")  # the pod is deleted: its sshd, prted and ranks are killed
            pods.discover("worker-0")
            elastickit.wait_for_steps(here, 1, 5, proc)
            pods.start("worker-1")  # its replacement runs sshd, and the operator lists it
            pods.discover("worker-0", "worker-1")
            stdout, stderr = elastickit.finish(proc, timeout=400)
    finally:  # the next test gets both workers
        if not pods.running("worker-1"):
            pods.start("worker-1")
        pods.discover("worker-0", "worker-1")
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    assert elastickit.sizes(here) == [4, 2, 4], stderr
    lost, kept = (pods.fqdn("worker-1"), pods.fqdn("worker-0"))
    lines = [line for line in stderr.splitlines() if line.startswith("mgpu-train: elastic:")]
    # mpirun names the pod it lost (or a rank there): that pod, not a bystander, is blacklisted
    assert any(re.fullmatch(rf"mgpu-train: elastic: {re.escape(lost)} failed: .*; "
                            rf"{re.escape(lost)} is blacklisted for 2 s \(--blacklist-cooldown\)",
                            line) for line in lines), stderr
    assert any(line.startswith(f"mgpu-train: elastic: restarting with 2 processes on {kept}:2 "
                               f"(was 4 on {kept}:2,{lost}:2)") for line in lines), stderr
    assert (f"mgpu-train: elastic: {lost} (2 slots) came; restart with 4 processes (now 2): "
            f"asking the job to stop at its next backup point") in lines, stderr
    runs = elastickit.attempts(here)
    assert [log["host"] for log in runs[1]] == ["mgpu-digits-worker-0"] * 2
    assert [log["host"] for log in runs[2]] == ["mgpu-digits-worker-0"] * 2 + [
        "mgpu-digits-worker-1"] * 2
    for epoch in range(3):  # each sample at most once, none lost beyond one step's remainder
        used = elastickit.used_samples(here, epoch)
        twice = [i for i, n in collections.Counter(used).items() if n > 1]
        assert not twice and len(used) > samples - 4 * BATCH, (epoch, twice, len(used))
    assert not pods.wait_until_empty(15), "processes left behind"


def test_the_keras_distribution_guide_and_the_ddp_tutorial_in_the_mpijob(mpi_operator_cluster):
    """Scripts written for Keras's distribution API (JAX) and for torchrun, unchanged, as the
    MPIJob's launcher command ``mgpu-train -np 4`` (docs/starting-processes.md): 2 ranks in
    each worker pod agree on the coordinator over MPI, worker-0's address as worker-1 dials
    it; the checks of the one-host tests, for 4 processes."""
    from test_foreign_scripts import DDP, GUIDE, JAX, check_ddp, check_guide, ddp_job

    pods = mpi_operator_cluster
    here, there = pods.volume_folder("guide")
    result = pods.mgpu_train("-np", "4", GUIDE, there, timeout=400, **JAX)
    assert result.returncode == 0, explain(result)
    reports = check_guide(here, result, size=4)
    coordinator = reports[0]["addresses"].split(",")[0].rsplit(":", 1)[0]
    dialled = subprocess.run(pods.command("worker-1", "getent", "ahostsv4",
                                          pods.fqdn("worker-0")),
                             capture_output=True, text=True, timeout=30)
    assert coordinator == dialled.stdout.split()[0], (coordinator, dialled.stdout)
    here, there = pods.volume_folder("ddp")
    result = ddp_job(lambda: pods.mgpu_train("-np", "4", DDP, there, "5", "1", timeout=400),
                     here, size=4)
    assert result.returncode == 0, explain(result)
    check_ddp(here, result, epochs=5, size=4)  # half the steps an epoch of 2 ranks
    assert not pods.wait_until_empty(15), "processes left behind"
