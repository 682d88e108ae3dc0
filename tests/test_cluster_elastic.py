"""Elastic training across the 2-node cluster (scripts/cluster.sh; tests/clusterkit.py).

mgpu-train runs on node1 with a discovery script that prints a file the test edits, so "node2
leaves" is the test killing node2's ranks and removing node2 from that file, and "node2 comes
back" is writing it again, as a cloud's instance list would change. The job is
tests/scripts/resize_ids.py on scikit-learn's digits: every rank logs the ids of the samples
each step trained on, and elastickit counts those that survived the lost steps. TensorFlow.

Marked ``cluster`` (root, network namespaces, openssh-server); not ``backend``: the elastic
loop and the sample accounting do not depend on the backend (tests/horovod/test_hvd_elastic.py and
tests/training/test_resume.py cover resuming on each).
"""

import collections
import os
import re
import signal

import pytest

import elastickit
from conftest import SCRIPTS, explain

pytestmark = [pytest.mark.cluster, pytest.mark.job]

RESIZE = os.path.join(SCRIPTS, "resize_ids.py")
SAMPLES, BATCH = 1280, 16  # 20 steps an epoch on 4 processes, 40 on 2
DIGITS = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2", "RESIZE_DATA": "digits",
          "RESIZE_SAMPLES": str(SAMPLES), "RESIZE_BATCH": str(BATCH), "RESIZE_EPOCHS": "6"}
ELASTIC = {"MGPU_DISCOVERY_INTERVAL": "0.5", "RESIZE_STEP_SECONDS": "0.1"}
#: node2's ranks get only the variables mgpu-train forwards (MGPU_*, KERAS_BACKEND, ...) and -x
FORWARD = [arg for name in [*DIGITS, "RESIZE_STEP_SECONDS"] for arg in ("-x", name)]


def _discovery(tmp_path, text):
    """A discovery script printing the file ``hosts`` (which the test then edits)."""
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    return hosts, elastickit.executable(tmp_path / "discover.sh", f"cat {hosts}")


def _run_elastic(cluster, tmp_path, hosts_text, *argv, **env):
    hosts, script = _discovery(tmp_path, hosts_text)
    out = tmp_path / "out"
    out.mkdir()
    proc = cluster.start_mgpu_train(*argv, *FORWARD, "--host-discovery-script", script, RESIZE,
                                    str(tmp_path / "backup"), str(out), **DIGITS, **ELASTIC,
                                    **env)
    return proc, hosts, out


def _elastic_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("mgpu-train: elastic:")]


def _show(lines, stdout, *more):
    """What docs/fault-tolerance.md quotes (pytest -s shows it)."""
    resumed = [line for line in stdout.splitlines() if "BackupAndRestore:" in line]
    print("", *lines, *resumed, *more, sep="\n")


def test_a_job_that_loses_node2_goes_on_on_node1_and_grows_back_when_it_returns(
        cluster, tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = cluster.mgpu_train("-np", "4", "-H", "node1:2,node2:2", *FORWARD, RESIZE,
                                       str(reference / "backup"), str(reference), **DIGITS)
    assert uninterrupted.returncode == 0, explain(uninterrupted)
    expected = elastickit.attempts(reference)[0][0]["accuracy"]

    proc, hosts, out = _run_elastic(cluster, tmp_path, "node1:2\nnode2:2\n", "-np", "4",
                                    "--min-np", "2", "--max-np", "4",
                                    "--blacklist-cooldown", "2")
    with elastickit.reaped(proc):
        # step 26 is batch 5 of epoch 1 (20 steps an epoch): after its first backup point
        elastickit.wait_for_steps(out, 0, 26, proc)
        for rank in (2, 3):  # node2's ranks (-H node1:2,node2:2)
            os.kill(elastickit.pid_of(out, 0, rank), signal.SIGKILL)
        hosts.write_text("node1:2\n")
        # node2 returns once the 2 processes on node1 are into the next epoch (40 steps an
        # epoch now): the epoch it was lost in is then finished by node1 alone
        elastickit.wait_for_steps(out, 1, 40, proc)
        hosts.write_text("node1:2\nnode2:2\n")
        stdout, stderr = elastickit.finish(proc, timeout=400)
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    assert elastickit.sizes(out) == [4, 2, 4], stderr
    lines = _elastic_lines(stderr)
    assert any(re.fullmatch(r"mgpu-train: elastic: node2 failed: rank [23] killed by signal 9 "
                            r"\(SIGKILL\); node2 is blacklisted for 2 s \(--blacklist-cooldown\)",
                            line) for line in lines), stderr
    assert any(line.startswith("mgpu-train: elastic: restarting with 2 processes on node1:2 "
                               "(was 4 on node1:2,node2:2): node2 failed") for line in lines), \
        stderr
    assert ("mgpu-train: elastic: node2 (2 slots) came; restart with 4 processes (now 2): "
            "asking the job to stop at its next backup point") in lines, stderr
    assert any(line.startswith("mgpu-train: elastic: restarting with 4 processes on "
                               "node1:2,node2:2 (was 2 on node1:2): the job stopped at its "
                               "backup after ") for line in lines), stderr
    runs = elastickit.attempts(out)
    assert [log["host"] for log in runs[1]] == ["node1", "node1"]
    assert [log["host"] for log in runs[2]] == ["node1", "node1", "node2", "node2"]

    # the epoch node2 was lost in: every sample exactly once, over both sizes
    lost_in = elastickit.resumed_from(runs[1][0])[0]
    used = elastickit.used_samples(out, lost_in)
    twice = [i for i, n in collections.Counter(used).items() if n > 1]
    assert not twice and sorted(used) == list(range(SAMPLES)), (lost_in, twice, len(used))
    # the others: each sample at most once; the grow may drop a remainder smaller than one
    # step of 4 processes (docs/fault-tolerance.md)
    for epoch in set(range(6)) - {lost_in}:
        used = elastickit.used_samples(out, epoch)
        assert len(set(used)) == len(used) > SAMPLES - 4 * BATCH, (epoch, len(used))

    accuracy = runs[2][0]["accuracy"]
    _show(lines, stdout, f"accuracy {accuracy:.4f}, uninterrupted {expected:.4f}")
    assert abs(accuracy - expected) <= 0.01, (
        f"digits accuracy {accuracy:.4f} after losing and regaining node2, {expected:.4f} "
        f"uninterrupted: more than 1 point apart")
    assert not cluster.wait_until_empty(15), "processes left behind"


def test_node2_leaving_below_min_np_stops_the_job_at_a_backup_with_nothing_left_running(
        cluster, tmp_path):
    proc, hosts, out = _run_elastic(cluster, tmp_path, "node1:1\nnode2:1\n", "-np", "2",
                                    "--min-np", "2", "--elastic-timeout", "3")
    with elastickit.reaped(proc):
        elastickit.wait_for_steps(out, 0, 5, proc)
        # node2 leaves the list with its rank still running: mgpu-train sends mpirun SIGUSR1,
        # which must reach node2's rank through Open MPI's daemon there
        hosts.write_text("node1:1\n")
        stdout, stderr = elastickit.finish(proc, timeout=120)
    assert proc.returncode == 1, f"{stdout}\n{stderr}"
    lines = _elastic_lines(stderr)
    assert ("mgpu-train: elastic: node2 left the discovered hosts; restart with 1 processes: "
            "asking the job to stop at its next backup point") in lines, stderr
    assert ("mgpu-train: elastic: stopping: 1 slots available (node1:1), fewer than --min-np 2, "
            "for 3 s (--elastic-timeout). No process of the job is left; its backups are where "
            "BackupAndRestore wrote them: start it again when enough hosts are back.") in lines, \
        stderr
    _show(lines, stdout)
    ranks = elastickit.attempts(out)[0]
    assert [(log["host"], log["resize_signal"]) for log in ranks] == [
        ("node1", True), ("node2", True)], "the resize signal did not reach both nodes' ranks"
    # the job stopped at a backup point: the backup is of the last step every rank trained
    epoch, batch, _ = ranks[0]["trained"][-1]
    assert [log["trained"][-1][:2] for log in ranks] == [[epoch, batch]] * 2
    assert os.listdir(tmp_path / "backup") == [f"epoch-{epoch}-batch-{batch + 1}.weights.h5"]
    assert not cluster.wait_until_empty(15), "processes left behind"
