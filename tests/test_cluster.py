"""Multi-host runs on a real 2-node cluster built on this machine (scripts/cluster.sh).

node1 and node2 are network + UTS + mount namespaces joined by a bridge, each with its own
sshd; every job is started from node1 with ``mgpu-train -H node1:2,node2:2`` (or
``--hostfile``), so Open MPI reaches node2 over ssh and the frameworks talk over the veth
addresses, exactly as between two machines. Both nodes' /etc/hosts map their own name to
127.0.1.1, as Debian's does.

Marked ``cluster``: they need root, network namespaces and openssh-server
(scripts/install_cluster_deps.sh), and FAIL when the cluster cannot be built. The exactness
test is also marked ``backend`` (run once per Keras backend: TF gRPC ring, JAX gloo, torch gloo).
"""

import glob
import json
import os
import pathlib
import signal
import subprocess
import time

import numpy as np
import pytest

from clusterkit import NODE_OF
from conftest import SCRIPTS, explain

pytestmark = [pytest.mark.cluster, pytest.mark.job]

REPORT = os.path.join(SCRIPTS, "report.py")
FAIL = os.path.join(SCRIPTS, "fail.py")
HOSTS = ("-np", "4", "-H", "node1:2,node2:2")
#: the nodes' network (scripts/cluster.sh): nodeN is SUBNET.N
SUBNET = "10.213.0"


def _reports(directory, size):
    return [json.loads((directory / f"rank.{rank}.json").read_text()) for rank in range(size)]


def _check_placement(reports):
    for report in reports:
        rank = report["rank"]
        assert report["host"] == NODE_OF[rank], report
        assert (report["local_rank"], report["local_size"]) == (rank % 2, 2), report
        assert (report["cross_rank"], report["cross_size"]) == (rank // 2, 2), report
        assert report["average"] == 2.5  # (1 + 2 + 3 + 4) / 4 over MPI, across the nodes


def test_hosts_start_two_ranks_on_each_node(cluster, tmp_path):
    result = cluster.mgpu_train(*HOSTS, REPORT, str(tmp_path), MGPU_ENGINE="none")
    assert result.returncode == 0, explain(result)
    _check_placement(_reports(tmp_path, 4))
    # node2's ranks reach rank 0's stall inspector (it once listened on node1's 127.0.1.1)
    assert "cannot reach rank 0" not in result.stderr, explain(result)  # the stall inspector


def test_hostfile_starts_two_ranks_on_each_node_without_the_env_on_the_remote_path(
        cluster, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the README's format\nnode1 slots=2\nnode2 slots=2\n")
    out = tmp_path / "out"
    out.mkdir()
    # node2's ssh sessions get no shell start-up file: PATH is the bare system one, without
    # this Python's bin/ (mpirun, prted). mgpu-train must not depend on it.
    bashrc = os.path.expanduser("~/.bashrc")
    blanked = os.path.exists(bashrc)
    if blanked:
        subprocess.run(cluster.command("node2", "mount", "--bind", "/dev/null", bashrc),
                       check=True, timeout=30)
    try:
        found = subprocess.run(cluster.command("node1", "ssh", "node2", "command -v prted"),
                               capture_output=True, text=True, timeout=30)
        assert found.returncode != 0, f"prted is on node2's ssh PATH: {found.stdout}"
        result = cluster.mgpu_train("-np", "4", "--hostfile", str(hostfile), REPORT, str(out),
                                    MGPU_ENGINE="none")
    finally:
        if blanked:
            subprocess.run(cluster.command("node2", "umount", bashrc), timeout=30)
    assert result.returncode == 0, explain(result)
    _check_placement(_reports(out, 4))


@pytest.mark.backend
def test_four_ranks_on_two_nodes_equal_one_process_with_the_global_batch(
        cluster, tmp_path_factory, plain_reference):
    """THE exactness check across a network: 2 nodes x 2 ranks x batch 2 == 1 x batch 8."""
    from test_training import BACKEND, QUIET, TRAIN, assert_ranks_identical, assert_same

    pytest.importorskip(BACKEND)
    expected = plain_reference
    out = tmp_path_factory.mktemp("cluster_run")
    result = cluster.mgpu_train(*HOSTS, TRAIN, json.dumps({}), str(out), **QUIET)
    assert result.returncode == 0, explain(result)
    weights = [[array for _, array in sorted(np.load(out / f"rank.{rank}.npz").items(),
                                             key=lambda item: int(item[0].split("_")[1]))]
               for rank in range(4)]
    assert_ranks_identical(weights)
    assert_same(weights[0], expected)


@pytest.mark.parametrize("how, cause", [
    ("raise", "rank 3 failed first: RuntimeError: boom on purpose from rank 3 (exit code 1)"),
    ("signal", "rank 3 failed first: killed by signal 9 (SIGKILL)"),
])
def test_a_failing_rank_on_node2_ends_the_job_on_both_nodes(cluster, tmp_path, how, cause):
    failed_at = tmp_path / "failed_at"
    result = cluster.mgpu_train(*HOSTS, FAIL, how, "3", str(failed_at),
                                timeout=120, MGPU_ENGINE="none")
    ended = time.time()
    assert result.returncode != 0, explain(result)
    assert cause in result.stderr, explain(result)
    summary = result.stderr[result.stderr.index("mgpu-train: the job failed"):]
    if how == "raise":  # node2's traceback, relayed to node1's console and into the summary
        assert "Traceback" in summary and "fail.py" in summary, summary
    took = ended - float(failed_at.read_text())
    assert took < 15, f"the job took {took:.1f} s to end after rank 3 failed\n{explain(result)}"
    assert not cluster.wait_until_empty(5), "processes left behind"


def test_ctrl_c_on_the_launcher_cleans_both_nodes(cluster, tmp_path):
    pidfile = str(tmp_path / "pid")
    proc = cluster.start_mgpu_train(*HOSTS, FAIL, "hang", "99", pidfile, MGPU_ENGINE="none")
    try:
        deadline = time.monotonic() + 90
        while len(glob.glob(pidfile + ".*")) < 4:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        ranks = cluster.leftovers()
        assert sum("node2" in line for line in ranks) >= 2, ranks  # really spread over both
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends (cluster.sh exec execs mgpu-train)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "got SIGINT, stopping every rank" in err
    assert not cluster.wait_until_empty(15), "processes left behind"


def test_the_ddp_tutorial_on_two_nodes_agrees_on_node1s_address(cluster, tmp_path):
    """A torchrun-style script across hosts (docs/starting-processes.md): the ranks agree on the
    coordinator over MPI before it runs, rank 0's address as node2 dials it (not node1's
    127.0.1.1), and each node's index in GROUP_RANK."""
    from test_foreign_scripts import DDP, ddp_job

    result = ddp_job(lambda: cluster.mgpu_train(*HOSTS, DDP, str(tmp_path), "2", "1",
                                                timeout=600), tmp_path, size=4)
    assert result.returncode == 0, explain(result)
    reports = _reports(tmp_path, 4)
    masters = {(report["env"]["MASTER_ADDR"], report["env"]["MASTER_PORT"]) for report in reports}
    assert len(masters) == 1 and not next(iter(masters))[0].startswith("127."), masters
    for rank, report in enumerate(reports):
        assert report["env"]["GROUP_RANK"] == str(rank // 2), report["env"]
        assert report["env"]["LOCAL_RANK"] == str(rank % 2) and report["size"] == 4
        assert report["weights"] == reports[0]["weights"]  # DDP across the nodes



def test_the_keras_distribution_guide_on_two_nodes_agrees_on_node1s_address(cluster, tmp_path):
    """keras-io's distribution guide (JAX, DataParallel) with one process on each node
    (docs/starting-processes.md): JAX's coordinator is node1's address as node2 dials it
    (not node1's 127.0.1.1), every process sees both, one global loss falls, equal weights.

    JAX's CPU collectives (gloo) bind the address the host's own name resolves to, and no
    variable changes that: with Debian's 127.0.1.1 (these nodes' default) the guide fails on
    any launcher, and mgpu-train hints at the fix (seen here; tests/launcher/test_foreign.py
    has the hint). So for this run each node's name resolves to its own address, as on hosts
    with DNS."""
    from test_foreign_scripts import GUIDE, JAX, check_guide

    hosts = {node: pathlib.Path(cluster.directory, f"hosts.{node}") for node in cluster.nodes}
    debian = {node: path.read_text() for node, path in hosts.items()}
    try:
        for node, path in hosts.items():  # /etc/hosts of each node is a bind mount of this file
            path.write_text(debian[node].replace(f"127.0.1.1 {node}",
                                                 f"{SUBNET}.{node[-1]} {node}"))
        result = cluster.mgpu_train("-np", "2", "-H", "node1:1,node2:1", GUIDE, str(tmp_path),
                                    timeout=600, **JAX)
        dialled = subprocess.run(cluster.command("node2", "getent", "ahostsv4", "node1"),
                                 capture_output=True, text=True, timeout=30)
    finally:
        for node, path in hosts.items():
            path.write_text(debian[node])
    assert result.returncode == 0, explain(result)
    reports = check_guide(tmp_path, result)
    node1 = dialled.stdout.split()[0]  # node1's address as node2 resolves it
    assert node1 == f"{SUBNET}.1", dialled.stdout
    for report in reports:
        coordinator = report["addresses"].split(",")[0]
        assert coordinator.rsplit(":", 1)[0] == node1, (coordinator, node1)
