"""Elastic training: resuming with another number of processes, and mgpu-train's elastic mode.

The size-change tests start real jobs (TensorFlow, CPU): a job is killed mid-epoch, and the
next one, with another -np, resumes from its step backup; tests/scripts/resize_ids.py logs the
ids of the samples every step trained on, and elastickit counts those that survived.
"""

import collections
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import elastickit
from conftest import ROOT, SCRIPTS, explain, launch, launch_ok, requires_mpirun

RESIZE = os.path.join(SCRIPTS, "resize_ids.py")
SAMPLES = 64
ENV = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _once_each(used, dropped_below, samples=SAMPLES):
    """Every id at most once, and all but fewer than `dropped_below` of the samples used."""
    twice = [i for i, n in collections.Counter(used).items() if n > 1]
    assert not twice, f"samples used twice: {twice}"
    assert samples - dropped_below < len(used) <= samples, sorted(used)


@requires_mpirun
@pytest.mark.job
@pytest.mark.parametrize("before, after, resumed, left", [
    # 2 x 4 samples a step: the backup after batch 3 of epoch 2 is at sample 24 of its order;
    # 1 process continues with batch 7 of 16 and uses all 64
    (2, 1, "resuming at epoch 2, batch 7", 0),
    # 1 x 4: the backup is at sample 12; 2 processes (8 a step) continue at batch 3 of 8
    # (samples 12..59) and drop the last 4, fewer than one step of the new size
    (1, 2, "resuming at epoch 2, batch 3", 4),
])
def test_a_job_resumed_with_another_size_uses_every_sample_of_the_epoch_once(
        tmp_path, before, after, resumed, left):
    pytest.importorskip("tensorflow")
    backup, out = str(tmp_path / "backup"), str(tmp_path / "out")
    os.mkdir(out)
    killed = launch("-np", str(before), RESIZE, backup, out, "1", "4", timeout=180, **ENV)
    assert killed.returncode != 0, explain(killed)
    assert os.listdir(backup) == ["epoch-1-batch-3.weights.h5"], explain(killed)
    result = launch_ok("-np", str(after), RESIZE, backup, out, timeout=180,
                       RESIZE_ATTEMPT="1", **ENV)
    processes = {1: "1 process", 2: "2 processes"}
    factor = after / before
    assert (f"{resumed} from {backup} (backed up by {processes[before]} after "
            f"{4 * (3 if before == 1 else 6)} samples of the epoch's order; now "
            f"{processes[after]}, learning rate 0.1 -> {0.1 * factor:g}, momentum buffers x "
            f"{factor:g})" in result.stdout), explain(result)
    # momentum correction (Goyal et al.): the velocity backed up after the step the backup
    # followed, scaled with the learning rate
    first = elastickit.attempts(out)[0][0]
    steps = [tuple(step[:2]) for step in first["trained"]]
    backed_up = first["velocity"][steps.index((1, 2))]  # epoch-1-batch-3: after batch 2
    assert elastickit.attempts(out)[1][0]["velocity_at_start"] == pytest.approx(
        backed_up * factor, rel=1e-5)
    assert elastickit.sizes(out) == [before, after]
    used = elastickit.used_samples(out, epoch=1)
    _once_each(used, dropped_below=after * 4)
    assert SAMPLES - len(used) == left
    for epoch in (0, 2):  # whole epochs, each with its own size
        assert sorted(elastickit.used_samples(out, epoch)) == list(range(SAMPLES))
    final = elastickit.attempts(out)[1]
    assert [log["learning_rate"] for log in final] == pytest.approx([0.1 * after / before] * after)


# -- mgpu-train's elastic mode ---------------------------------------------------------------
from mgpu_launcher import cli, discovery  # noqa: E402


@pytest.mark.parametrize("argv, with_script, message", [
    (["-np", "2", "--min-np", "3", "--max-np", "2"], True,
     "--min-np 3 is more than --max-np 2: expected min <= max"),
    (["-np", "5", "--min-np", "2", "--max-np", "4"], True,
     "-np 5 is outside [--min-np 2, --max-np 4]: give an -np between them"),
    (["-np", "2", "--min-np", "zero"], True, "--min-np 'zero': expected a number >= 1"),
    (["-np", "2", "--elastic-timeout", "-1"], True, "--elastic-timeout '-1': expected a number"),
    (["-np", "2", "--min-np", "2"], False, "--min-np only apply with --host-discovery-script"),
    (["-np", "2", "-H", "a:2"], True, "leave out --hosts and --hostfile"),
    (["--min-np", "2"], False, "--min-np only apply when mgpu-train starts the job: add -np N"),
])
def test_bad_elastic_combinations_are_usage_errors(tmp_path, capsys, argv, with_script,
                                                   message):
    if with_script:
        argv = argv + ["--host-discovery-script", elastickit.executable(tmp_path / "d.sh", "echo a:2")]
    assert cli.main([*argv, "-c", "pass"]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_or_plain_file_discovery_script_is_a_usage_error(tmp_path, capsys):
    plain = tmp_path / "hosts.txt"
    plain.write_text("localhost:2\n")
    assert cli.main(["-np", "2", "--host-discovery-script", str(tmp_path / "no.sh"),
                     "-c", "pass"]) == 2
    assert "no.sh': no such file" in capsys.readouterr().err
    assert cli.main(["-np", "2", "--host-discovery-script", str(plain), "-c", "pass"]) == 2
    assert f"is not executable: chmod +x {plain}" in capsys.readouterr().err


def test_the_environment_gives_the_elastic_options(tmp_path, monkeypatch):
    script = elastickit.executable(tmp_path / "discover.sh", "echo localhost:2")
    monkeypatch.setenv("MGPU_HOST_DISCOVERY_SCRIPT", script)
    monkeypatch.setenv("MGPU_MIN_NP", "1")
    monkeypatch.setenv("MGPU_MAX_NP", "3")
    options = cli.parse_args(["-np", "2", "-c", "pass"]).elastic_options
    assert (options.script, options.min_np, options.max_np) == (script, 1, 3)
    # under mpirun/srun (worker mode) the variables reach every rank and are not for it
    assert cli.parse_args(["-c", "pass"]).elastic_options is None


def test_discovery_output_is_checked_line_by_line(tmp_path):
    hosts = discovery.discover(elastickit.executable(tmp_path / "d.sh", "printf '%s\\n' 'node1:2' "
                                       "'# a comment' '' 'node2' 'bad host:x' 'node3:0' "
                                       "'node1:4' 'node4:two'"))
    assert hosts.slots == (("node1", 2), ("node2", 1))
    assert hosts.total == 3
    assert [p.split(", ", 1)[1] for p in hosts.problems] == [
        "line 5: 'bad host:x' skipped: expected HOST:SLOTS, e.g. node1:4",
        "line 7: node1 listed again; its first line counts",
        "line 8: 'node4:two' skipped: expected HOST:SLOTS, e.g. node1:4"]


@pytest.mark.parametrize("body, message", [
    ("echo oops >&2; exit 3", "exited with status 3: oops"),
    ("echo 'not a host list'", "listed no host with a slot"),
    ("sleep 5", "did not finish in 0.5 s"),
])
def test_a_failing_discovery_script_is_an_error_not_a_crash(tmp_path, body, message):
    with pytest.raises(discovery.DiscoveryError, match=message):
        discovery.discover(elastickit.executable(tmp_path / "d.sh", body), timeout=0.5)


def test_discovery_output_is_bounded_in_size_and_lines(tmp_path):
    # Issue 37: a 400 MB "host name" took the launcher to 1.5 GB of memory.
    with pytest.raises(discovery.DiscoveryError,
                       match=rf"printed more than {discovery.MAX_OUTPUT_BYTES} bytes"):
        discovery.discover(elastickit.executable(
            tmp_path / "big.sh", "head -c 50000000 /dev/zero | tr '\\0' a; echo :1"))
    with pytest.raises(discovery.DiscoveryError,
                       match=rf"printed more than {discovery.MAX_LINES} lines"):
        discovery.discover(elastickit.executable(
            tmp_path / "long.sh", f"yes node1:1 | head -n {discovery.MAX_LINES + 1}"))


def test_host_names_that_are_not_host_names_are_skipped_with_the_reason(tmp_path):
    hosts = discovery.discover(elastickit.executable(tmp_path / "d.sh", "printf '%s\\n' "
                               "'-Hnode9:2' '--mca:1' 'node1:2' 'a..b:1' 'node-2.example.org:1' "
                               "'node$(id):1' 'x-:1'"))
    assert hosts.slots == (("node1", 2), ("node-2.example.org", 1))  # never `mpirun -H -H...`
    expected = ("a host name: letters, digits, '-' and '_' in dot-separated labels of 1 to 63 "
                "characters, none starting or ending with '-'")
    assert [p.split(", ", 1)[1] for p in hosts.problems] == [
        f"line 1: '-Hnode9' skipped: expected {expected}",
        f"line 2: '--mca' skipped: expected {expected}",
        f"line 4: 'a..b' skipped: expected {expected}",
        f"line 6: 'node$(id)' skipped: expected {expected}",
        f"line 7: 'x-' skipped: expected {expected}"]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("body, message", [
    ("sleep 300 & echo $! > {pid}; echo node1:1",
     r"exited \(status 0\), but a process it started kept its output open for 1 s"),
    ("sleep 300 & echo $! > {pid}; sleep 300", "did not finish in 1 s"),
])
def test_a_script_past_its_time_has_its_whole_process_group_ended(tmp_path, body, message):
    pid = tmp_path / "child.pid"
    script = elastickit.executable(tmp_path / "d.sh", body.format(pid=pid))
    started = time.monotonic()
    try:
        with pytest.raises(discovery.DiscoveryError, match=message + ".*process group was ended"):
            discovery.discover(script, timeout=1)
        assert time.monotonic() - started < 10
        child = int(pid.read_text())
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the script's background child was left running"
    finally:
        if pid.exists() and _alive(int(pid.read_text())):
            os.kill(int(pid.read_text()), signal.SIGKILL)


def test_a_blacklisted_host_cools_down_longer_after_each_failure():
    now = [100.0]
    blacklist = discovery.Blacklist(10, clock=lambda: now[0])
    assert blacklist.add("node2") == 10 and blacklist.blocked() == ["node2"]
    now[0] += 10.5
    assert blacklist.blocked() == []
    assert blacklist.add("node2") == 20
    now[0] += 19
    assert blacklist.blocked() == ["node2"]
    np, placed = discovery.place(discovery.parse("node1:2\nnode2:2\n"), 3)
    assert (np, str(placed)) == (3, "node1:2,node2:1")
    assert [placed.host_of_rank(rank) for rank in range(4)] == ["node1", "node1", "node2", None]


def _elastic(tmp_path, hosts_file, *argv, samples=SAMPLES, **env):
    return elastickit.start_resize_job(tmp_path, hosts_file, *argv, samples=samples,
                                       **{**ENV, **env})


_nothing_left = elastickit.nothing_left


# Two "hosts" that are both this machine: Open MPI places ranks 0-1 on localhost and 2-3 on
# 127.0.0.1 (-H localhost:2,127.0.0.1:2), so killing ranks 2 and 3 and dropping 127.0.0.1 from
# discovery is losing the second host. tests/test_cluster.py does it with two real nodes.
@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
def test_an_elastic_job_goes_on_without_a_lost_host_and_grows_back(tmp_path):
    pytest.importorskip("tensorflow")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.1:2\n")
    proc, out = _elastic(tmp_path, hosts, "-np", "4", "--min-np", "2", "--max-np", "4",
                         "--blacklist-cooldown", "2", samples=128)
    with elastickit.reaped(proc):
        # 8 steps an epoch at 4 processes; step 13 is batch 5 of epoch 2, after the backup
        # that followed batch 3 (sample 48 of the epoch's order)
        elastickit.wait_for_steps(out, 0, 13, proc)
        for rank in (2, 3):
            os.kill(elastickit.pid_of(out, 0, rank), signal.SIGKILL)
        time.sleep(1)
        hosts.write_text("localhost:2\n")
        elastickit.wait_for_steps(out, 1, 2, proc)
        hosts.write_text("localhost:2\n127.0.0.1:2\n")
        stdout, stderr = elastickit.finish(proc, timeout=300)
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    assert elastickit.sizes(out) == [4, 2, 4], stderr
    lines = [line for line in stderr.splitlines() if line.startswith("mgpu-train: elastic:")]
    assert lines[0] == ("mgpu-train: elastic: starting 4 processes on localhost:2,127.0.0.1:2 "
                        "(--min-np 2, --max-np 4)")
    assert any(re.fullmatch(r"mgpu-train: elastic: 127\.0\.0\.1 failed: rank [23] killed by "
                            r"signal 9 \(SIGKILL\); 127\.0\.0\.1 is blacklisted for 2 s "
                            r"\(--blacklist-cooldown\)", line) for line in lines), stderr
    assert any(line.startswith("mgpu-train: elastic: restarting with 2 processes on "
                               "localhost:2 (was 4 on localhost:2,127.0.0.1:2): 127.0.0.1 "
                               "failed") for line in lines), stderr
    assert ("mgpu-train: elastic: 127.0.0.1 (2 slots) came; restart with 4 processes (now 2): "
            "asking the job to stop at its next backup point") in lines, stderr
    assert any(line.startswith("mgpu-train: elastic: restarting with 4 processes on "
                               "localhost:2,127.0.0.1:2 (was 2 on localhost:2): the job "
                               "stopped at its backup after ") for line in lines), stderr
    assert ("resuming at epoch 2, batch 7 from " in stdout
            and "(backed up by 4 processes after 48 samples of the epoch's order; now 2 "
                "processes, learning rate 0.1 -> 0.05, momentum buffers x 0.5)" in stdout), stdout
    assert "now 4 processes, learning rate 0.05 -> 0.1, momentum buffers x 2)" in stdout, stdout
    # every epoch, also those the kill and the grow cut: each sample once, but for a remainder
    # smaller than one step of 4 processes (when the grow came mid-epoch)
    for epoch in range(3):
        _once_each(elastickit.used_samples(out, epoch), dropped_below=16, samples=128)


@requires_mpirun
@pytest.mark.job
def test_fewer_slots_than_min_np_stop_the_job_cleanly(tmp_path):
    pytest.importorskip("tensorflow")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    proc, out = _elastic(tmp_path, hosts, "-np", "2", "--min-np", "2",
                         "--elastic-timeout", "3", "--blacklist-cooldown", "60")
    with elastickit.reaped(proc):
        elastickit.wait_for_steps(out, 0, 5, proc)
        hosts.write_text("localhost:1\n")
        os.kill(elastickit.pid_of(out, 0, 1), signal.SIGKILL)
        stdout, stderr = elastickit.finish(proc, timeout=120)
    assert proc.returncode == 137, f"{stdout}\n{stderr}"
    assert ("mgpu-train: elastic: stopping: 1 slots available (localhost:1; blacklisted: "
            "127.0.0.1), fewer than --min-np 2, for 3 s (--elastic-timeout). No process of the "
            "job is left") in stderr, stderr
    assert elastickit.sizes(out) == [2]
    # 8 steps an epoch; killed after step 5, the backup after step 3 is intact
    assert os.listdir(tmp_path / "backup") == ["epoch-0-batch-3.weights.h5"]
    for rank in (0, 1):
        pid = elastickit.pid_of(out, 0, rank)
        assert not os.path.exists(f"/proc/{pid}"), f"rank {rank} (pid {pid}) is still alive"


# Issue 39: fewer slots on a host of the job is a removal of those slots (Horovod's rule).
@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
def test_a_host_offering_fewer_slots_scales_the_job_down(tmp_path):
    pytest.importorskip("tensorflow")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    proc, out = _elastic(tmp_path, hosts, "-np", "2", "--min-np", "1", "--max-np", "2",
                         RESIZE_EPOCHS="2")
    with elastickit.reaped(proc):
        elastickit.wait_for_steps(out, 0, 4, proc)
        hosts.write_text("localhost:1\n")
        stdout, stderr = elastickit.finish(proc, timeout=240)
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    assert elastickit.sizes(out) == [2, 1], stderr
    assert ("mgpu-train: elastic: localhost offers 1 slots, the job runs 2 processes there; "
            "restart with 1 processes (now 2): asking the job to stop at its next backup "
            "point") in stderr, stderr
    assert ("mgpu-train: elastic: restarting with 1 processes on localhost:1 (was 2 on "
            "localhost:2): the job stopped at its backup after ") in stderr, stderr
    for epoch in range(2):  # the cut epoch too: each sample once (2 x 4 a step, then 1 x 4)
        _once_each(elastickit.used_samples(out, epoch), dropped_below=8)
    _nothing_left(out)


@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
def test_a_host_offering_fewer_slots_than_min_np_stops_the_job(tmp_path):
    pytest.importorskip("tensorflow")
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    proc, out = _elastic(tmp_path, hosts, "-np", "2", "--min-np", "2", "--elastic-timeout", "3")
    with elastickit.reaped(proc):
        elastickit.wait_for_steps(out, 0, 4, proc)
        hosts.write_text("localhost:1\n")
        stdout, stderr = elastickit.finish(proc, timeout=180)
    assert proc.returncode == 1, f"{stdout}\n{stderr}"
    assert ("mgpu-train: elastic: localhost offers 1 slots, the job runs 2 processes there; "
            "restart with 1 processes (now 2)") in stderr, stderr
    assert ("mgpu-train: elastic: stopping: 1 slots available (localhost:1), fewer than "
            "--min-np 2, for 3 s (--elastic-timeout). No process of the job is left") in stderr
    assert elastickit.sizes(out) == [2]
    assert os.listdir(tmp_path / "backup"), "the job stopped at a backup point: one is there"
    _nothing_left(out)


@pytest.mark.parametrize("signum,inherited", [(signal.SIGTERM, signal.SIG_DFL),
                                              (signal.SIGINT, signal.SIG_DFL),
                                              (signal.SIGINT, signal.SIG_IGN)],
                         ids=["SIGTERM", "SIGINT", "SIGINT-inherited-ignored"])
def test_mgpu_train_stopped_during_discovery_leaves_no_process_of_the_script(tmp_path, signum,
                                                                             inherited):
    # Issue 51, item 5: SIGTERM to an elastic mgpu-train while its discovery script ran left
    # the script's background child running (SIGINT did not). SIGINT inherited ignored (a job
    # started with `&` from a script): mgpu-train kept discovering (a loaded run of 2026-11-27,
    # started in the background, failed here); it stops as it does during an attempt.
    pids = tmp_path / "pids"
    script = elastickit.executable(tmp_path / "discover.sh", f"""
        sleep 300 >/dev/null 2>&1 &
        echo $! $$ > {pids}.tmp && mv {pids}.tmp {pids}
        sleep 60
        echo localhost:2""")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "mgpu_launcher", "-np", "2",
                             "--host-discovery-script", script, "-c", "pass"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    try:
        deadline = time.monotonic() + 30
        while not pids.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert pids.exists(), proc.communicate(timeout=30)[0] if proc.poll() is not None else \
            "the discovery script did not start in 30 s"
        children = [int(pid) for pid in pids.read_text().split()]
        proc.send_signal(signum)
        status = proc.wait(timeout=30)
        assert status == 128 + signum, proc.stdout.read()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in children), "a process of the script was left"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pids.exists():  # on a failure, still leave nothing: the script leads its group
            try:
                os.killpg(int(pids.read_text().split()[1]), signal.SIGKILL)
            except ProcessLookupError:
                pass
