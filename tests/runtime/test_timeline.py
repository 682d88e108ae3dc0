"""The timeline recorder on one process: a valid trace, written atomically, never through a
planted link. (tests/training/test_efficiency.py runs it on a 2-process job.)"""

import json
import os
import time

import pytest

import timelinekit
from mgpu_launch import runtime
from mgpu_launch.runtime import timeline


@pytest.fixture
def one_process(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("MGPU_", "OMPI_", "PMI"))]:
        monkeypatch.delenv(name)
    runtime.init()
    yield
    runtime.shutdown()


def record_two_steps():
    for step in (1, 2):
        timeline.phase("on_train_batch_begin", "callbacks", step)
        timeline.phase("train step", "step", step)
        with timeline.span("input wait", "input"):
            time.sleep(0.002)
        timeline.phase("next batch", "input", step)
    timeline.phase(None)


def test_a_trace_holds_the_phases_with_their_nested_slices(tmp_path, one_process):
    target = tmp_path / "new" / "trace.json"
    timeline.start(str(target), runtime.state)
    record_two_steps()
    assert timeline.stop() == str(target)
    tracks = timelinekit.check_trace(json.loads(target.read_text()))
    names = [e["name"] for e in tracks[(0, 0)]]
    assert names == ["on_train_batch_begin", "train step", "input wait", "next batch"] * 2
    assert [e["args"]["step"] for e in tracks[(0, 0)] if e["name"] == "train step"] == [1, 2]
    assert not timeline.recording()
    assert [p.name for p in target.parent.iterdir()] == ["trace.json"]  # no temporary left


def test_a_link_planted_at_the_target_is_replaced_not_written_through(tmp_path, one_process):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "trace.json"
    target.symlink_to(victim)
    timeline.start(str(target), runtime.state)
    record_two_steps()
    timeline.stop()
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and json.loads(target.read_text())["traceEvents"]


def test_the_ring_keeps_the_newest_slices_only():
    recorder = timeline.Recorder(capacity=5)
    for step in range(1, 9):
        recorder.phase("train step", "step", step)
    recorder.phase(None, "", 0)
    assert [s[5] for s in recorder.slices] == [4, 5, 6, 7, 8]
    assert [s[5] for s in recorder.since(recorder.appended - 2)] == [7, 8]


def test_an_empty_path_says_what_is_expected(one_process):
    with pytest.raises(ValueError, match="expected a path"):
        timeline.start("  ", runtime.state)
