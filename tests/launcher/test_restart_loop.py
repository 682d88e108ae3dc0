"""The one restart loop (mgpu_launcher.restarts.run_attempts) under both of its policies, fixed
restarts and elastic, with attempts that return scripted outcomes instead of running mpirun:
the loop, the policies and the decisions are the real ones (issue 52, item 4)."""

import elastickit
from mgpu_launcher import elastic, restarts
from mgpu_launcher.supervisor import Failure, Outcome

FAILED_AFTER_A_STEP = Outcome(1, progressed=True, cause=Failure(1, "ValueError: x (exit code 1)"))


def _fixed(outcomes, max_restarts):
    """Run the fixed policy over `outcomes`; (status, the attempts it started, its env)."""
    env, started = {}, []

    def supervise(attempt):
        started.append((attempt, dict(env)))
        return outcomes[len(started) - 1]

    return restarts.run_attempts(restarts.FixedRestarts(max_restarts, env, supervise)), started


def test_fixed_restarts_stop_after_n_restarts_with_the_last_status(capsys):
    status, started = _fixed([FAILED_AFTER_A_STEP, FAILED_AFTER_A_STEP,
                              Outcome(137, progressed=True), Outcome(0)], max_restarts=2)
    assert status == 137  # the third attempt's; the fourth outcome is never asked for
    assert [attempt for attempt, _ in started] == [(1, 3), (2, 3), (3, 3)]
    assert [env[restarts.RESTART_VARIABLE] for _, env in started] == ["0", "1", "2"]
    assert capsys.readouterr().err == (
        "mgpu-train: restarting (1 of 2 restarts used): attempt 1 failed (rank 1: ValueError: x "
        "(exit code 1)); every process of it is gone.\n"
        "mgpu-train: restarting (2 of 2 restarts used): attempt 2 failed (rank 1: ValueError: x "
        "(exit code 1)); every process of it is gone.\n")  # and nothing after the last


def test_without_restarts_an_attempt_is_not_numbered_and_gets_no_restart_variables(capsys):
    status, started = _fixed([Outcome(1)], max_restarts=0)
    assert (status, started) == (1, [(None, {})])
    assert capsys.readouterr().err == ""  # not even "not restarting": none was asked for


def test_a_success_ends_the_loop():
    status, started = _fixed([FAILED_AFTER_A_STEP, Outcome(0), Outcome(1)], max_restarts=5)
    assert (status, len(started)) == (0, 2)


def test_a_failure_before_the_first_step_is_not_restarted(capsys):
    status, started = _fixed([Outcome(1, cause=Failure(0, "SyntaxError")), Outcome(0)], 3)
    assert (status, len(started)) == (1, 1)
    assert capsys.readouterr().err == (
        "mgpu-train: not restarting: attempt 1 failed before its first training step was done "
        "(e.g. a SyntaxError, an ImportError or a bad argument), so every restart would fail "
        "the same way. Fix the error above and run again.\n")


def test_mgpu_train_stopped_by_a_signal_ends_the_loop():
    assert _fixed([Outcome(130, stopped_by=2), Outcome(0)], max_restarts=3)[0] == 130


def _elastic(tmp_path, outcomes, max_restarts=3, **options):
    script = elastickit.executable(tmp_path / "discover.sh", "echo a:2; echo b:1")
    policy = elastic.ElasticRestarts(
        elastic.Options(script, min_np=1, max_np=None, timeout=0, **options),
        lambda np, hosts, attempt, on_start: started.append((np, str(hosts), attempt))
        or outcomes[len(started) - 1], max_restarts)
    started = []
    return restarts.run_attempts(policy), started


def test_elastic_restarts_blacklist_the_failing_host_and_start_without_it(tmp_path, capsys):
    # rank 2 runs on b (a:2 holds ranks 0 and 1); a killed rank is excused before a step
    killed = Outcome(137, cause=Failure(2, "killed by signal 9 (SIGKILL)"))
    status, started = _elastic(tmp_path, [killed, Outcome(0)])
    assert status == 0
    assert started == [(3, "a:2,b:1", 0), (2, "a:2", 1)]
    err = capsys.readouterr().err
    assert ("mgpu-train: elastic: b failed: rank 2 killed by signal 9 (SIGKILL); b is "
            "blacklisted for 60 s (--blacklist-cooldown)\n") in err
    assert ("mgpu-train: elastic: restarting with 2 processes on a:2 (was 3 on a:2,b:1): b "
            "failed (rank 2: killed by signal 9 (SIGKILL)); the job resumes from its last "
            "backup\n") in err


def test_elastic_restarts_stop_when_the_restarts_are_used(tmp_path, capsys):
    status, started = _elastic(tmp_path, [FAILED_AFTER_A_STEP] * 5, max_restarts=1,
                               cooldown=0, stop_repeated=False)
    assert (status, len(started)) == (1, 2)
    assert capsys.readouterr().err.endswith(
        "mgpu-train: elastic: stopping: a failed (rank 1: ValueError: x (exit code 1)), and the "
        "1 restarts allowed are used (--max-restarts)\n")


def test_elastic_a_repeated_failure_and_an_early_one_stop_the_loop(tmp_path, capsys):
    status, started = _elastic(tmp_path, [FAILED_AFTER_A_STEP] * 5, cooldown=0)
    assert (status, len(started)) == (1, 2)
    assert "restarts were stopped because the failure repeated" in capsys.readouterr().err
    status, started = _elastic(tmp_path, [Outcome(1, cause=Failure(0, "SyntaxError"))] * 2)
    assert (status, len(started)) == (1, 1)
    assert "mgpu-train: elastic: not restarting: attempt 1 failed" in capsys.readouterr().err


def test_elastic_a_resize_starts_again_and_is_no_failure(tmp_path, capsys):
    status, started = _elastic(tmp_path, [Outcome(0, resized="backup"), Outcome(0)],
                               max_restarts=0)
    assert (status, len(started)) == (0, 2)
    assert "the job stopped at its backup (asked)" in capsys.readouterr().err
