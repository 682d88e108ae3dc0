"""Rank-0 atomic checkpoints and the throughput callback, on real 2-process runs."""

import json
import os

import pytest

from conftest import BACKEND, SCRIPTS, explain, launch, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.job,
              pytest.mark.usefixtures("backend")]
keras = pytest.importorskip("keras")

RECIPE = os.path.join(SCRIPTS, "recipe.py")
ENV = {"KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.first_backend
def test_checkpoints_are_written_once_by_rank_0_and_throughput_is_logged(tmp_path):
    launch_ok("-np", "2", RECIPE, "checkpoint", str(tmp_path), timeout=180, **ENV)
    assert sorted(os.listdir(tmp_path / "rank0")) == [f"model-{e}.keras" for e in (1, 2, 3)]
    assert not (tmp_path / "rank1").exists()
    everything = [name for _, _, files in os.walk(tmp_path) for name in files]
    assert not [name for name in everything if ".partial-" in name]
    assert (tmp_path / "best.weights.h5").exists()
    keras.models.load_model(tmp_path / "rank0" / "model-3.keras", compile=False)
    histories = [json.loads((tmp_path / f"history.{r}.json").read_text()) for r in range(2)]
    # Summed over ranks with one collective: the same figure on both ranks, every epoch.
    assert histories[0]["samples_per_sec"] == histories[1]["samples_per_sec"]
    assert len(histories[0]["samples_per_sec"]) == 3
    assert all(rate > 0 for rate in histories[0]["samples_per_sec"])


@pytest.mark.first_backend
def test_a_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    result = launch("-np", "2", RECIPE, "kill", str(tmp_path), timeout=180, **ENV)
    assert result.returncode != 0
    assert "SIGKILL" in result.stderr or "signal 9" in result.stderr, explain(result)
    # The first epoch's checkpoint survives under the final name, whole.
    model = keras.models.load_model(tmp_path / "model.keras", compile=False)
    assert model.count_params() == 4 * 2 + 2
