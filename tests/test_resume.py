"""Resume after a kill: a restarted job ends with the weights of an uninterrupted one."""

import os

import numpy as np
import pytest

from conftest import SCRIPTS, explain, launch, requires_mpirun

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
pytestmark = [requires_mpirun, pytest.mark.backend]
pytest.importorskip(BACKEND)

RESUME = os.path.join(SCRIPTS, "resume.py")
ENV = {"KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "2"}


def run(backup, out, *kill):
    return launch("-np", "2", RESUME, str(backup), str(out), *kill, timeout=180, **ENV)


def weights(out):
    return [list(np.load(out / f"rank.{r}.npz").values()) for r in range(2)]


def test_killed_mid_epoch_then_restarted_equals_uninterrupted(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "resumed").mkdir()
    reference = run(tmp_path / "ref-backup", tmp_path / "ref")
    assert reference.returncode == 0, explain(reference)
    assert not (tmp_path / "ref-backup").exists()  # removed after a normal finish

    killed = run(tmp_path / "backup", tmp_path / "resumed", "2")
    assert killed.returncode != 0
    # Epochs 0 and 1 finished: the backup to resume from is the one before epoch 2.
    assert os.listdir(tmp_path / "backup") == ["epoch-2.weights.h5"], explain(killed)

    resumed = run(tmp_path / "backup", tmp_path / "resumed")
    assert resumed.returncode == 0, explain(resumed)
    assert "resuming at epoch 3" in resumed.stdout
    expected, got = weights(tmp_path / "ref"), weights(tmp_path / "resumed")
    for rank in range(2):
        for a, b in zip(got[rank], expected[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
