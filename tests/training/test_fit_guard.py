"""Ranks whose fit would run different steps fail together, before the first step."""

import os
import subprocess

import pytest

from conftest import BACKEND, SCRIPTS, explain, launch, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job, pytest.mark.usefixtures("backend")]


#: mode of tests/scripts/uneven.py -> the disagreement its MismatchError must name
DISAGREEING = {"train": "steps per epoch: [2, 3]",
               "validation": "validation batches: [1, 2]",
               "freq": "validation_freq: [1, 2]"}


# One job runs every mode in turn (a TensorFlow start-up per rank, not one per mode); each mode's
# lines start with its name, so each is checked on its own. "train" goes last, its error not
# caught: the job must fail as a user's would.
def test_disagreeing_ranks_stop_with_the_values_named_and_agreeing_ones_train():
    modes = ["validation", "freq", "unknown", "agree", "train"]
    try:
        result = launch("-np", "2", os.path.join(SCRIPTS, "uneven.py"), *modes, timeout=240,
                        KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    except subprocess.TimeoutExpired as error:
        started = [line.split(":")[0] for line in str(error.stdout or "").splitlines()]
        pytest.fail(f"the job hung after the modes {started} (one of the next hangs): "
                    f"{error.stdout}\n{error.stderr}")
    assert result.returncode != 0, explain(result)
    by_mode = {mode: [line for line in result.stdout.splitlines()
                      if line.startswith(f"[0] {mode}: ")] for mode in modes}
    for mode in ("validation", "freq"):
        said = "\n".join(by_mode[mode])
        assert f"{mode}: MismatchError" in said and DISAGREEING[mode] in said, \
            f"mode {mode}: no MismatchError naming {DISAGREEING[mode]!r}\n{explain(result)}"
        assert "mgpu.data.shard" in said, f"mode {mode}: no advice\n{explain(result)}"
        assert "trained" not in said, f"mode {mode}: a fit ran to its end\n{explain(result)}"
    assert any("cannot check that every rank runs the same number of steps" in line
               for line in by_mode["unknown"]), f"mode unknown: no warning\n{explain(result)}"
    assert any(line.startswith("[0] unknown: rank 0 trained") for line in by_mode["unknown"]), \
        f"mode unknown: fit did not run\n{explain(result)}"
    assert "[0] agree: rank 0 trained 2 epochs" in by_mode["agree"], \
        f"mode agree: did not train 2 epochs\n{explain(result)}"
    # the last mode's error, uncaught, ended the job: Python's traceback names it
    assert "MismatchError" in result.stderr and DISAGREEING["train"] in result.stderr, \
        f"mode train: no MismatchError naming {DISAGREEING['train']!r}\n{explain(result)}"
    assert "mgpu.data.shard" in result.stderr, f"mode train: no advice\n{explain(result)}"
    assert not by_mode["train"], f"mode train: a fit ran to its end\n{explain(result)}"
