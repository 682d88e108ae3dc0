"""mgpu-train's elastic mode when an attempt fails: which host is blacklisted (a rank's, or one
mpirun lost), the failing rank's error as the root cause, and no restart of a failure that
repeats identically (issue 39, item 6; issue 41: a deleted worker pod)."""

import pytest

import elastickit
from conftest import requires_mpirun

ENV = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _elastic(tmp_path, hosts_file, *argv, **env):
    return elastickit.start_resize_job(tmp_path, hosts_file, *argv, **{**ENV, **env})


_nothing_left = elastickit.nothing_left


def test_a_host_mpirun_lost_before_the_first_step_is_blacklisted_and_the_job_restarts(
        tmp_path, capsys):
    """A worker pod deleted while the job starts (the MPI Operator's discovery script lists it
    for up to a minute more): no rank failed, mpirun says it lost the host; the job goes on
    without it rather than stopping as a program error would."""
    from mgpu_launcher import elastic, supervisor

    script = elastickit.executable(tmp_path / "discover.sh", "echo w0.job.svc; echo w1.job.svc")
    options = elastic.Options(script, min_np=2, max_np=4, timeout=5, cooldown=60, bare_slots=2)
    started = []

    def start(np, placed, attempt, on_start):
        started.append(str(placed))
        if len(started) == 1:  # prterun names w1 by its first label, ssh by the whole name
            return supervisor.Outcome(255, lost_hosts=("w1", "w1.job.svc"))
        return supervisor.Outcome(0)

    assert elastic.run(options, start) == 0
    assert started == ["w0.job.svc:2,w1.job.svc:2", "w0.job.svc:2"]
    assert ("mgpu-train: elastic: w1.job.svc failed: mpirun lost its daemon there, or could not "
            "start one over ssh; w1.job.svc is blacklisted for 60 s (--blacklist-cooldown)"
            ) in capsys.readouterr().err
    # a failure before the first step that no lost host explains is still not restarted
    started.clear()
    assert elastic.run(options, lambda *args: started.append(str(args[1]))
                       or supervisor.Outcome(1)) == 1
    assert started == ["w0.job.svc:2,w1.job.svc:2"]


# Issue 39: an elastic job's own error is its root cause, and an error that comes back at the
# same point is not restarted again and again. One process on one host (the size an elastic job
# may shrink to; a rank of a 1-process job had no failure marker), no cool-down: every restart
# may start at once.
def _failing(tmp_path, raises):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    proc, out = _elastic(tmp_path, hosts, "-np", "1", "--min-np", "1", "--max-restarts", "4",
                         "--blacklist-cooldown", "0", RESIZE_STEP_SECONDS="0",
                         RESIZE_RAISE=raises)
    with elastickit.reaped(proc):
        stdout, stderr = elastickit.finish(proc, timeout=400)
    _nothing_left(out)
    return proc.returncode, stderr, len(elastickit.attempts(out))


@pytest.mark.parametrize("reasons, stop, attempts", [
    (["ValueError: bad batch (exit code 1)"] * 9, True, 2),
    (["ValueError: bad batch (exit code 1)"] * 9, False, 5),  # MGPU_STOP_REPEATED_FAILURE=0
    (["killed by signal 9 (SIGKILL)"] * 9, True, 5),  # a lost host may come back
    (["ValueError: a (exit code 1)", "ValueError: b (exit code 1)"] * 5, True, 5),
])
def test_only_the_same_error_twice_in_a_row_stops_the_restarts(tmp_path, reasons, stop,
                                                                attempts):
    # The loop alone, each attempt's outcome given (the job tests above run the real ones).
    from mgpu_launcher import elastic, supervisor
    options = elastic.Options(elastickit.executable(tmp_path / "d.sh", "echo localhost:1"),
                              1, None, cooldown=0, stop_repeated=stop)
    made = []

    def start(np, placed, attempt, on_start):
        made.append(attempt)
        return supervisor.Outcome(1, progressed=True, cause=supervisor.Failure(0, reasons[attempt]))

    assert elastic.run(options, start, max_restarts=4) == 1
    assert len(made) == attempts


ROOT_CAUSE = ("  root cause: rank 0 failed first: RuntimeError: the data source failed (exit "
              "code 1)\n  last lines of rank 0's stderr:\n")


@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
def test_an_error_that_repeats_at_the_same_point_stops_the_restarts(tmp_path):
    pytest.importorskip("tensorflow")
    # every attempt fails at batch 5 of epoch 1, after the backup of batch 3 it resumes from
    status, stderr, attempts = _failing(tmp_path, "*:0:4")
    assert status == 1, stderr
    assert attempts == 2, stderr  # not the 5 that --max-restarts 4 allows
    assert stderr.count(ROOT_CAUSE) == 2, stderr
    assert "root cause: unknown" not in stderr, stderr
    assert ("mgpu-train: elastic: stopping: restarts were stopped because the failure repeated "
            "identically: the last two attempts both failed with the same error, RuntimeError: "
            "the data source failed (exit code 1) (rank 0), after the same backup point (backup "
            "after batch 3 of epoch 1); every further restart would fail the same way (1 of the "
            "4 restarts allowed used).") in stderr, stderr


@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
@pytest.mark.parametrize("raises, attempts", [
    ("0:0:4", 2),  # once
    ("0:0:4,1:1:4", 3),  # twice, the second time after more backups: progress, not a repeat
])
def test_a_transient_error_is_restarted_and_named(tmp_path, raises, attempts):
    pytest.importorskip("tensorflow")
    status, stderr, made = _failing(tmp_path, raises)
    assert status == 0, stderr
    assert made == attempts, stderr
    assert stderr.count(ROOT_CAUSE) == attempts - 1, stderr
    assert "restarts were stopped" not in stderr, stderr
