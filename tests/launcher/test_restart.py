"""mgpu-train --max-restarts: a failed job is torn down and started again, like torchrun's."""

import os

import numpy as np
import pytest

import faultkit
from conftest import (BACKEND, SCRIPTS, assert_ok, explain, launch, launch_ok, rank_weights,
                      requires_mpirun)
from mgpu_launcher import cli


@pytest.mark.parametrize("argv, env, message", [
    (["-np", "2", "--max-restarts", "two"], {}, "--max-restarts 'two': expected a whole number"),
    (["-np", "2"], {"MGPU_MAX_RESTARTS": "-1"}, "MGPU_MAX_RESTARTS='-1': expected a whole number"),
    (["--max-restarts", "1"], {}, "--max-restarts only apply when mgpu-train starts the job"),
])
def test_bad_restart_counts_are_usage_errors(argv, env, message, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main([*argv, "-c", "pass"]) == 2
    assert message in capsys.readouterr().err


def test_the_environment_gives_the_default(monkeypatch):
    monkeypatch.setenv("MGPU_MAX_RESTARTS", "3")
    assert cli.parse_args(["-np", "2", "-c", "pass"]).max_restarts == 3
    assert cli.parse_args(["-np", "2", "--max-restarts", "0", "-c", "pass"]).max_restarts == 0


# Recovery from a SIGKILLed rank (exit 0, training resumed) is the resume test below, on every
# backend; this one checks the summaries, the teardown and the status when no attempt succeeds.
@requires_mpirun
@pytest.mark.job
def test_every_attempt_failing_gives_the_last_attempts_status(tmp_path, backend):
    out = str(tmp_path)
    run = faultkit.finish(faultkit.start(out, "kill", 3, "--max-restarts", "1",
                                         KERAS_BACKEND=backend, FAULT_EVERY_ATTEMPT="1"),
                          out, timeout=300)
    assert run.returncode == 137, run.explain()  # mpirun's status for a SIGKILLed rank
    assert "mgpu-train: attempt 1 of 2 failed (exit status 137)" in run.stderr, run.explain()
    assert "mgpu-train: restarting (1 of 1 restarts used)" in run.stderr
    assert "mgpu-train: attempt 2 of 2 failed (exit status 137)" in run.stderr
    assert run.stderr.count("root cause: rank 1 failed first: killed by signal 9 (SIGKILL)") == 2
    assert os.path.exists(tmp_path / "pid.1.1")  # the second attempt ran
    assert not faultkit.leftovers(out), faultkit.leftovers(out)


@requires_mpirun
@pytest.mark.job
def test_a_script_that_fails_before_its_first_step_is_not_restarted():
    result = launch("-np", "2", "--max-restarts", "3", "-c", "import no_such_module_here",
                    timeout=120, MGPU_ENGINE="none")
    assert result.returncode == 1, explain(result)
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in result.stderr
    assert "mgpu-train: attempt 1 of 4 failed" in result.stderr
    assert "not restarting: attempt 1 failed before its first training step" in result.stderr
    assert "attempt 2 of 4" not in result.stderr


def _resume(backup, out, *kill, **env):
    return launch("-np", "2", "--max-restarts", "1", os.path.join(SCRIPTS, "resume.py"),
                  str(backup), str(out), *kill, timeout=300, KERAS_BACKEND=BACKEND,
                  TF_CPP_MIN_LOG_LEVEL="2", **env)


def _check_restart_equals_uninterrupted(tmp_path, resume_reference, **env):
    # resume_reference (tests/conftest.py): the uninterrupted run, one job for all such tests
    (tmp_path / "restarted").mkdir()
    restarted = assert_ok(_resume(tmp_path / "backup", tmp_path / "restarted", "2", **env))
    assert "root cause: rank 1 failed first: killed by signal 9" in restarted.stderr
    assert "BackupAndRestore: resuming" in restarted.stdout, explain(restarted)
    expected, got = rank_weights(resume_reference[0]), rank_weights(tmp_path / "restarted")
    for rank in range(2):
        for a, b in zip(got[rank], expected[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.first_backend
@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
@pytest.mark.usefixtures("backend")
def test_restarted_with_epoch_backups_ends_like_an_uninterrupted_run(tmp_path, resume_reference):
    _check_restart_equals_uninterrupted(tmp_path, resume_reference)


# The kill is mid-epoch (epoch 2, batch 2) and the backup every 3 steps
# (BackupAndRestore(save_freq=3)), so the restart resumes mid-epoch.
@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
@pytest.mark.usefixtures("backend")
def test_restarted_with_step_backups_ends_like_an_uninterrupted_run(tmp_path, resume_reference):
    _check_restart_equals_uninterrupted(tmp_path, resume_reference, RESUME_SAVE_FREQ="3")


# Keras's fit(shuffle=True) is the default: shard()'s data must not be reordered by it, or the
# resumed epoch drops batches of an order nobody can replay (measured before: 27% off). The
# reference (tests/conftest.py, shared with test_resume.py) is fit(shuffle=False) without a
# kill: the restarted plain fit must end with its weights.
@pytest.mark.first_backend
@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
def test_a_plain_fit_on_shuffled_shard_data_resumes_exactly(tmp_path, backend,
                                                           resume_steps_reference):
    (tmp_path / "restarted").mkdir()
    restarted = launch_ok("-np", "2", "--max-restarts", "1",
                          os.path.join(SCRIPTS, "resume_steps.py"), str(tmp_path / "backup"),
                          str(tmp_path / "restarted"), "1", "4", timeout=300,
                          KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2", RESUME_PLAIN_FIT="1")
    assert "resuming at epoch 2, batch 4" in restarted.stdout, explain(restarted)
    assert "root cause: rank 1 failed first: killed by signal 9" in restarted.stderr
    expected, got = rank_weights(resume_steps_reference), rank_weights(tmp_path / "restarted")
    for rank in range(2):
        for a, b in zip(got[rank], expected[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# -- the supervisor's reading of an attempt's output (canned mpirun lines, no job) ----------
def _relay(*lines):
    import io

    from mgpu_launcher import mpirun, supervisor
    relay = supervisor.OutputRelay(mpirun.OPENMPI, False, None, io.StringIO(), io.StringIO())
    for line in lines:
        relay.line(line, "stderr")
    return relay


def test_a_signal_death_is_the_root_cause_of_the_errors_it_caused():
    relay = _relay("[1,0]<stderr>: mgpu-train: rank failure: UnavailableError: Connection reset "
                   "by peer (exit code 1)",
                   "prterun noticed that process rank 1 with PID 123 on node vm exited on "
                   "signal 9 (Killed).")
    assert relay.summary(137, (1, 2)).splitlines()[:2] == [
        "mgpu-train: attempt 1 of 2 failed (exit status 137).",
        "  root cause: rank 1 failed first: killed by signal 9 (SIGKILL)"]


def test_a_stall_shutdown_names_the_late_rank_and_the_progress_marker_is_not_shown():
    relay = _relay("[1,0]<stderr>: mgpu-train: first step done",
                   "[1,1]<stderr>: stuck here",
                   "[1,0]<stderr>: mgpu-train: job stalled: [1] rank 1 has not entered step 6 "
                   "for 9 s (last seen in on_train_batch_end of step 5)",
                   "prterun noticed that process rank 1 with PID 123 on node vm exited on "
                   "signal 15 (Terminated).")
    assert relay.progressed
    assert "first step done" not in relay.stderr.getvalue()
    summary = relay.summary(1)
    assert ("root cause: the job stalled: rank 1 has not entered step 6 for 9 s (last seen in "
            "on_train_batch_end of step 5)") in summary
    assert "last lines of rank 1's stderr:\n    stuck here" in summary


# prterun's own lines when an MPI Operator worker pod was deleted mid-run (its sshd and prted
# SIGKILLed; tests/test_cluster_mpi_operator.py, Open MPI 5.0.11): no rank reports anything.
POD_DELETED = [
    "Connection to mgpu-digits-worker-1.mgpu-digits.default.svc closed by remote host.",
    "------------------------------------------------------------",
    "A daemon failed to report back after being spawned. This could",
    "be due to several factors, including inability to find the",
    "back to prterun:",
    "",
    "  Local host:    mgpu-digits-launcher",
    "  Remote host:   mgpu-digits-worker-1",
    "  Daemon exit status: 255",
    "",
    "------------------------------------------------------------",
]
# ... and in another run, after which prterun exited with status 0
POD_DELETED_EXIT_0 = [
    "PRTE has lost communication with a remote daemon.",
    "",
    "  HNP daemon   : [prterun-mgpu-digits-launcher-16314@0,0] on node mgpu-digits-launcher",
    "  Remote daemon: [prterun-mgpu-digits-launcher-16314@0,2] on node mgpu-digits-worker-1",
    "",
    "This is usually due to either a failure of the TCP network",
]


def test_a_host_mpirun_lost_is_the_root_cause_when_no_rank_names_one():
    from mgpu_launcher import discovery, mpirun
    from mgpu_launcher.hostlists import parse_hosts

    assert mpirun.OPENMPI.lost_hosts_in(POD_DELETED) == [
        "mgpu-digits-worker-1.mgpu-digits.default.svc", "mgpu-digits-worker-1"]
    assert mpirun.OPENMPI.lost_hosts_in([
        "ssh: connect to host node2 port 2222: Connection refused",
        "ssh: Could not resolve hostname node3: Name or service not known",
        "  Remote daemon: [prterun-vm-1234@2] on node node4"]) == ["node2", "node3", "node4"]
    assert mpirun.OPENMPI.lost_hosts_in(POD_DELETED_EXIT_0) == ["mgpu-digits-worker-1"]
    assert mpirun.MPICH.lost_hosts_in(POD_DELETED) == []
    # prterun shortens the name it was given; ssh keeps it: both are the same host of the -H list
    hosts = parse_hosts("mgpu-digits-worker-0.mgpu-digits.default.svc:2,"
                        "mgpu-digits-worker-1.mgpu-digits.default.svc:2")
    assert discovery.hosts_named(mpirun.OPENMPI.lost_hosts_in(POD_DELETED), hosts) == [
        "mgpu-digits-worker-1.mgpu-digits.default.svc"]
    assert discovery.hosts_named(["node2"], parse_hosts("node2.a:1,node2.b:1")) == []  # which one: unknown
    assert discovery.hosts_named(["node2"], parse_hosts("node1:2,node2:2")) == ["node2"]
    assert discovery.hosts_named(["mgpu-digits-launcher"], hosts) == []
    summary = _relay(*POD_DELETED).summary(255)
    assert summary.splitlines()[1] == (
        "  root cause: mpirun lost or could not reach "
        "mgpu-digits-worker-1.mgpu-digits.default.svc, mgpu-digits-worker-1: its daemon there "
        "ended or did not start (the host went away, or ssh to it failed); see mpirun's "
        "messages above."), summary


def test_mpirun_exiting_0_after_losing_a_host_is_a_failed_job():
    import io
    import sys

    from mgpu_launcher import mpirun, supervisor

    # stands in for prterun: its own lines as a real one printed them, then exit status 0
    said = "; ".join(f"print({line!r})" for line in POD_DELETED_EXIT_0)
    err = io.StringIO()
    outcome = supervisor.supervise([sys.executable, "-c", said], mpirun.OPENMPI,
                                   stdout=io.StringIO(), stderr=err)
    assert (outcome.status, outcome.lost_hosts) == (1, ("mgpu-digits-worker-1",))
    assert "root cause: mpirun lost or could not reach mgpu-digits-worker-1: " in err.getvalue()
    ok = supervisor.supervise([sys.executable, "-c", "print('done')"], mpirun.OPENMPI,
                              stdout=io.StringIO(), stderr=io.StringIO())
    assert (ok.status, ok.lost_hosts) == (0, ())
