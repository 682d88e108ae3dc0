"""The stall inspector: a rank that stops meeting the others is named, and may end the job."""

import pytest

import faultkit
from conftest import requires_mpirun
from mgpu_launch.runtime import stall


def test_the_report_names_the_late_rank_and_where_the_others_wait():
    positions = {0: (6, stall.TRAIN_STEP, ""), 1: (5, stall.BATCH_END, ""),
                 2: (6, stall.TRAIN_STEP, "")}
    late, text = stall.stall_report(positions, 60.4)
    assert late == [1]
    assert text == ("rank 1 has not entered step 6 for 60 s (last seen in on_train_batch_end "
                    "of step 5); ranks 0, 2 are waiting in step 6's gradient allreduce")


def test_ranks_at_one_place_are_no_stall():
    assert stall.stall_report({0: (3, stall.TRAIN_STEP, ""), 1: (3, stall.TRAIN_STEP, "x")},
                              100) is None


def test_epoch_end_positions_read_well():
    late, text = stall.stall_report({0: (16, stall.EPOCH_END, "epoch 1"),
                                     1: (16, stall.VALIDATION, "")}, 7)
    assert text == ("rank 1 has not reached on_epoch_end after step 16 (epoch 1) for 7 s "
                    "(last seen in validation after step 16); rank 0 is waiting in "
                    "on_epoch_end after step 16 (epoch 1)")


def test_a_rank_late_for_fit_is_named_too():
    late, text = stall.stall_report({0: (0, stall.FIT_BEGIN, ""), 1: (0, stall.STARTED, "")}, 61)
    assert text == ("rank 1 has not reached on_train_begin of fit for 61 s (last seen in the "
                    "program before its first training step); rank 0 is waiting in "
                    "on_train_begin of fit")


def test_bad_settings_say_what_is_expected(monkeypatch):
    monkeypatch.setenv("MGPU_STALL_SHUTDOWN_S", "soon")
    with pytest.raises(ValueError, match="MGPU_STALL_SHUTDOWN_S='soon': expected a number"):
        stall.settings()
    monkeypatch.setenv("MGPU_STALL_SHUTDOWN_S", "off")
    monkeypatch.setenv("MGPU_STALL_WARNING_S", "5")
    assert stall.settings() == (True, 5.0, None)
    monkeypatch.setenv("MGPU_STALL_INSPECTOR", "0")
    assert stall.settings()[0] is False


def test_positions_only_move_forward(monkeypatch):
    monkeypatch.setattr(stall, "_position", (0, stall.STARTED, ""))
    stall.mark(6, stall.BATCH_BEGIN)
    stall.mark(5, stall.AFTER_STEP)  # a batch end delivered late by Keras's callback thread
    assert stall.position() == (6, stall.BATCH_BEGIN, "")
    stall.mark(6, stall.TRAIN_STEP)
    assert stall.position() == (6, stall.TRAIN_STEP, "")


@pytest.mark.first_backend
@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
def test_a_stalled_rank_is_named_then_the_job_is_shut_down(tmp_path, backend):
    out = str(tmp_path)
    # Rank 1 sleeps in on_train_batch_end of step 5 while rank 0 waits in step 6's allreduce.
    proc = faultkit.start(out, "sleep", 5, KERAS_BACKEND=backend, MGPU_STALL_WARNING_S="5",
                          MGPU_STALL_SHUTDOWN_S="12")
    run = faultkit.finish(proc, out, timeout=240)
    assert run.returncode not in (None, 0), run.explain()
    stalled_at = run.written("fault.0")
    assert stalled_at is not None, run.explain()

    warning = run.first("mgpu: stall: rank 1 has not entered step 6 for")
    assert warning is not None, run.explain()
    assert ("(last seen in on_train_batch_end of step 5); rank 0 is waiting in step 6's "
            "gradient allreduce") in warning[1], warning[1]
    assert warning[0] - stalled_at <= 5 + 10, f"warned {warning[0] - stalled_at:.1f} s late"
    assert "faults.py" in run.stderr  # rank 1's Python stack, asked for by rank 0

    summary = run.stderr[run.stderr.index("mgpu-train: the job failed"):]
    assert ("root cause: the job stalled: rank 1 has not entered step 6 for 12 s (last seen "
            "in on_train_batch_end of step 5)") in summary, run.explain()
    assert "MGPU_STALL_SHUTDOWN_S=12" in summary
    gone = faultkit.gone_at(run, out)
    assert gone - stalled_at <= 12 + 15, f"gone {gone - stalled_at:.1f} s after the stall"
    assert not faultkit.leftovers(out), faultkit.leftovers(out)


@requires_mpirun
@pytest.mark.job
def test_a_stall_that_ends_is_one_warning_and_the_job_finishes(tmp_path, backend):
    out = str(tmp_path)
    proc = faultkit.start(out, "sleep", 5, KERAS_BACKEND=backend, MGPU_STALL_WARNING_S="3",
                          FAULT_SLEEP_S="10", FAULT_EPOCHS="1")
    run = faultkit.finish(proc, out, timeout=240)
    assert run.returncode == 0, run.explain()
    assert run.stderr.count("mgpu: stall: rank 1 has not entered step 6") == 1, run.explain()
    # (the "stall: over" notice may not come: the job can end before the monitor's next look)
    assert "rank 0 finished" in run.stdout
