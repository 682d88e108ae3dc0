"""The launcher's markers in the ranks' output (issue 58, item 4): only a marker line of this job
(whole, carrying the job's marker key) is read as one; a rank's own text that merely holds a
marker string is shown and kept like any other line, and never counts as progress."""

import io
import os

import pytest

from conftest import explain, launch, requires_mpirun
from mgpu_launch.config import markers
from mgpu_launcher import mpirun, supervisor

KEY = "0123456789abcdef"
FORGED = [
    "note: mgpu-train: first step done, or so this line says",
    markers.PROGRESS_MARKER,  # whole, but without the job's key: the rank's own words
    "user text: mgpu-train: rank failure: not the launcher's",
    "mgpu-train: job stalled: [1] not the inspector",
    "mgpu-train: backup point: epoch 9",
    "[Gloo] Rank 0 is connected to 0 peer ranks. (the user's own words)",
]


def relay_of(key=KEY):
    out, err = io.StringIO(), io.StringIO()
    relay = supervisor.OutputRelay(mpirun.OPENMPI, False, None, out, err, size=2,
                                   marker_key=key)
    return relay, err


def test_marker_strings_inside_a_ranks_text_are_text():
    relay, err = relay_of()
    for text in FORGED:
        relay.line(f"[1,0]<stderr>: {text}", "stderr")
    relay.flush()
    assert not relay.progressed and relay.backup is None and relay.root_cause() is None
    shown = err.getvalue()
    for text in FORGED:
        assert text in shown, shown
    summary = relay.summary(3)
    assert "root cause: unknown" not in summary and "exit status 3" in summary, summary
    assert summary.endswith("\n".join(f"    {text}" for text in FORGED)), summary


def test_the_jobs_own_marker_lines_are_read_and_the_key_is_not_shown():
    relay, err = relay_of()
    relay.line(f"[1,0]<stderr>: {KEY}:{markers.PROGRESS_MARKER}", "stderr")
    relay.line(f"[1,0]<stderr>: {KEY}:{markers.BACKUP_MARKER} epoch 2 batch 0", "stderr")
    # CI, 1 raised fault in 20: stray bytes in front of the marker line
    relay.line(f"[1,1]<stderr>: \ufffd{KEY}:{markers.FAILURE_MARKER} RuntimeError: boom "
               f"(exit code 1)", "stderr")
    relay.flush()
    assert relay.progressed and relay.backup == "epoch 2 batch 0"
    assert relay.root_cause() == supervisor.Failure(1, "RuntimeError: boom (exit code 1)")
    assert KEY not in err.getvalue() and "mgpu-train: rank failure: RuntimeError" in err.getvalue()
    # a marker of another job (another key) is text
    other, _ = relay_of()
    other.line(f"[1,0]<stderr>: fedcba9876543210:{markers.PROGRESS_MARKER}", "stderr")
    assert not other.progressed


def test_without_a_key_only_whole_lines_at_the_start_are_markers():
    relay, _ = relay_of(key=None)
    relay.line(f"[1,0]<stderr>: said: {markers.PROGRESS_MARKER}", "stderr")
    assert not relay.progressed
    relay.line(f"[1,0]<stderr>: {markers.PROGRESS_MARKER}", "stderr")
    assert relay.progressed


def test_a_rank_prints_its_markers_with_the_jobs_key(monkeypatch):
    monkeypatch.setenv(markers.KEY_VARIABLE, KEY)
    assert markers.line(markers.BACKUP_MARKER, "epoch 1") == f"{KEY}:{markers.BACKUP_MARKER} epoch 1"
    monkeypatch.delenv(markers.KEY_VARIABLE)
    assert markers.line(markers.PROGRESS_MARKER) == markers.PROGRESS_MARKER


SCRIPT = "; ".join(["import os, sys"] + [
    f"print({text!r}, file=sys.stderr, flush=True)" for text in FORGED] + ["os._exit(3)"])


@requires_mpirun
@pytest.mark.job
def test_a_job_printing_marker_strings_fails_with_its_exit_code_and_is_not_restarted():
    result = launch("-np", "2", "--max-restarts", "1", "-c", SCRIPT, MGPU_ENGINE="none")
    assert result.returncode != 0, explain(result)
    assert "root cause: unknown" not in result.stderr, explain(result)
    assert "not restarting" in result.stderr and "restarting (1 of 1" not in result.stderr, \
        explain(result)
    assert "user text: mgpu-train: rank failure: not the launcher's" in result.stderr
    assert "failed first: not the launcher's" not in result.stderr, explain(result)
    assert "exit code 3" in result.stderr or "exit status 3" in result.stderr, explain(result)
