"""Ranks whose fit would run different steps fail together, before the first step."""

import os

import pytest

from conftest import BACKEND, SCRIPTS, assert_ok, explain, launch, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job, pytest.mark.usefixtures("backend")]


def run(mode):
    return launch("-np", "2", os.path.join(SCRIPTS, "uneven.py"), mode, timeout=180,
                  KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")


@pytest.mark.parametrize("mode, named", [
    ("train", "steps per epoch: [2, 3]"),
    ("validation", "validation batches: [1, 2]"),
    ("freq", "validation_freq: [1, 2]"),
])
def test_disagreeing_ranks_stop_with_the_values_named(mode, named):
    result = run(mode)
    assert result.returncode != 0, explain(result)
    output = result.stdout + result.stderr
    assert "MismatchError" in output and named in output, explain(result)
    assert "mgpu.data.shard" in output
    assert "trained" not in result.stdout  # not one step ran to the end


def test_unknown_length_warns_and_agreeing_ranks_train():
    result = assert_ok(run("unknown"))
    assert "cannot check that every rank runs the same number of steps" in result.stderr
    result = assert_ok(run("agree"))
    assert "rank 0 trained 2 epochs" in result.stdout  # rank 1 exited 0 too (return code)
