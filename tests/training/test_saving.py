"""A model trained with DistributedOptimizer is a plain Keras model once saved.

Files written under mgpu (model.save, ModelCheckpoint's .keras and .weights.h5) load in a
process where mgpu_launch cannot be imported, with the inner optimizer's state intact, and
training goes on there; mgpu.load_model re-wraps them (tests/scripts/saving.py checks both).
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import BACKEND, SCRIPTS, assert_ok, explain, job_env, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job, pytest.mark.usefixtures("backend")]
SAVING = os.path.join(SCRIPTS, "saving.py")
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def load_without_mgpu(out, backend):
    """saving.py load in `python -I` (no PYTHONPATH, no user site), mgpu_launch blocked."""
    assert_ok(subprocess.run([sys.executable, "-I", SAVING, "load", str(out)],
                             env=job_env(KERAS_BACKEND=backend, **QUIET), capture_output=True,
                             text=True, timeout=300))
    return json.loads((out / "loaded.json").read_text())


def check_training_went_on(report, backend):
    assert report["backend"] == backend
    for name in ("model.keras", "ckpt-2.keras", "ckpt-2.weights.h5"):
        entry = report[name]
        # Each rank fits all 32 samples in batches of 4: 8 steps per epoch, 2 epochs saved,
        # then 1 more epoch in plain Keras.
        assert entry["saved_iterations"] == 16, entry
        assert entry["iterations"] == 24 and entry["weights_changed"], entry
        assert 0 < entry["loss"] < 1.5, entry  # 3 classes: ln 3 = 1.1 at chance


@pytest.mark.first_backend
@pytest.mark.backend
def test_saved_files_load_and_train_in_plain_keras(tmp_path):
    saved = launch_ok("-np", "2", SAVING, "save", str(tmp_path), timeout=300,
                      KERAS_BACKEND=BACKEND, **QUIET)
    assert "re-wrapped with the saved settings" in saved.stdout, explain(saved)
    check_training_went_on(load_without_mgpu(tmp_path, BACKEND), BACKEND)


def test_saved_under_jax_loads_under_tensorflow(tmp_path):
    pytest.importorskip("jax")
    pytest.importorskip("tensorflow")
    launch_ok("-np", "2", SAVING, "save", str(tmp_path), timeout=300, KERAS_BACKEND="jax",
              **QUIET)
    check_training_went_on(load_without_mgpu(tmp_path, "tensorflow"), "tensorflow")
