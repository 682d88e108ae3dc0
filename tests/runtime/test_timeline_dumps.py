"""A job that ends without ``mgpu.shutdown()`` still leaves its timeline: each rank's slices
up to the crash, the SIGTERM or the stall, with the phase it was in, in FILE.rank<N>.json; the merge
command joins them. Real 2-process jobs (TensorFlow: the recorder is backend-independent,
the efficiency tests run it on every backend). tests/runtime/test_launch.py runs
``mgpu_launch.run(..., timeline=FILE)``."""

import json
import os
import subprocess
import sys

import pytest

import timelinekit
from conftest import (ROOT, SCRIPTS, explain, launch, processes_mentioning, python_env,
                      requires_mpirun)
from mgpu_launch.runtime import trace_files

WORKER = os.path.join(SCRIPTS, "efficiency.py")
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow", "MGPU_PREFETCH": "1"}


def merged(tmp_path, *paths):
    out = tmp_path / "merged.json"
    result = subprocess.run([sys.executable, "-m", "mgpu_launch.runtime.trace_files", "merge",
                             str(out), *map(str, paths)], cwd=ROOT, env=python_env(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, explain(result)
    return timelinekit.check_trace(json.loads(out.read_text()))


def open_slices(tracks, rank):
    return [e for e in tracks[(rank, 0)] if e["args"].get("open")]


@requires_mpirun
@pytest.mark.job
def test_a_crashing_rank_leaves_its_slices_up_to_the_failing_phase(tmp_path):
    trace = tmp_path / "trace.json"
    result = launch("-np", "2", "--timeline", str(trace), WORKER, "crash", timeout=240, **ENV)
    assert result.returncode != 0, explain(result)
    assert "fails on purpose before step 10" in result.stderr
    dump = tmp_path / "trace.json.rank1.json"
    assert dump.exists(), explain(result)
    assert f"timeline so far written to {dump}" in result.stderr
    assert not trace.exists()  # the collective write never came: the dump is what is left
    tracks = merged(tmp_path, dump)
    assert [e["name"] for e in open_slices(tracks, 1)] == ["on_train_batch_begin"]
    assert open_slices(tracks, 1)[0]["args"]["step"] == 11  # steps count from 1, batches 0
    steps = {e["args"]["step"] for e in tracks[(1, 0)] if e["name"] == "train step"}
    assert set(range(1, 11)) <= steps, steps


@requires_mpirun
@pytest.mark.job
def test_a_rank_ended_by_sigterm_leaves_its_slices_and_is_named(tmp_path):
    # What Slurm's time limit, scancel or mpirun's teardown does: the rank's SIGTERM handler
    # (mgpu_launch.runtime.timeline_signals) writes its dump, then the rank exits 143.
    trace = tmp_path / "trace.json"
    result = launch("-np", "2", "--timeline", str(trace), WORKER, "sigterm", timeout=240,
                    **ENV)
    assert result.returncode != 0, explain(result)
    dump = tmp_path / "trace.json.rank1.json"
    assert f"rank 1: timeline so far written to {dump} (SIGTERM)" in result.stderr, \
        explain(result)
    assert json.loads(dump.read_text())["otherData"]["reason"] == "SIGTERM"
    tracks = merged(tmp_path, dump)
    assert [(e["name"], e["args"]["step"]) for e in open_slices(tracks, 1)] == [
        ("on_train_batch_begin", 11)]
    assert "root cause: rank 1 failed first: killed by signal 15 (SIGTERM)" in result.stderr, \
        explain(result)
    assert not processes_mentioning(str(tmp_path)), processes_mentioning(str(tmp_path))


@requires_mpirun
@pytest.mark.job
@pytest.mark.slow
def test_a_stall_leaves_the_stalled_rank_and_rank_0_in_one_merged_trace(tmp_path):
    trace = tmp_path / "trace.json"
    result = launch("-np", "2", "--timeline", str(trace), WORKER, "stall", timeout=240,
                    MGPU_STALL_WARNING_S="3", MGPU_STALL_SHUTDOWN_S="10", **ENV)
    assert result.returncode != 0, explain(result)
    dumps = [tmp_path / f"trace.json.rank{rank}.json" for rank in (0, 1)]
    assert all(d.exists() for d in dumps), explain(result)
    tracks = merged(tmp_path, *dumps)
    stalled = open_slices(tracks, 1)
    assert [e["name"] for e in stalled] == ["on_train_batch_begin"], stalled
    assert stalled[0]["dur"] >= 3e6  # microseconds: it had been there since the warning
    waiting = open_slices(tracks, 0)  # rank 0 waits for rank 1 in the step's allreduce
    assert [(e["name"], e["args"]["step"]) for e in waiting] == [("train step", 11)], waiting
    assert stalled[0]["args"]["step"] == 11
    # one time axis: rank 1's stalled slice began before rank 0's dump was written
    assert stalled[0]["ts"] < waiting[0]["ts"] + waiting[0]["dur"]


def test_a_bad_timeline_argument_says_what_is_expected():
    import mgpu_launch
    with pytest.raises(ValueError, match="timeline=''; expected a file path"):
        mgpu_launch.run(print, np=1, timeline="")


def test_merge_refuses_a_file_that_is_no_trace_and_a_bad_command_line(tmp_path, capsys):
    (tmp_path / "no.json").write_text('{"events": []}')
    with pytest.raises(ValueError, match="expected a trace-event JSON object"):
        trace_files.merge([str(tmp_path / "no.json")])
    assert trace_files.main(["merge", str(tmp_path / "out.json")]) == 2
    assert "usage: python3 -m mgpu_launch.runtime.trace_files merge OUT FILE" in \
        capsys.readouterr().err
