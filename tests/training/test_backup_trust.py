"""BackupAndRestore trusts no folder another user made and no backup that is not data it wrote
(issue 37, item 3). The attacks run as user nobody against this (root) process's fit."""

import json
import math
import os
import shutil
import stat

import numpy as np
import pytest

from conftest import as_nobody, shared_folder

pytestmark = pytest.mark.usefixtures("backend")


def _model(lr=0.1):
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse")
    return model


def _fit(model, *callbacks, epochs=1):
    x = np.arange(48, dtype="float32").reshape(16, 3) / 48
    y = np.ones((16, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def _backup(folder, **options):
    import mgpu_launch as mgpu

    return mgpu.callbacks.BackupAndRestore(str(folder), **options)


def _a_real_backup(folder):
    """Path of the epoch-1 backup one epoch of a fresh model leaves in `folder`."""
    _fit(_model(), _backup(folder, delete_checkpoint=False))
    return os.path.join(folder, "epoch-1.weights.h5")


def _set_state(path, text):
    import h5py

    with h5py.File(path, "a") as store:
        store.attrs["mgpu_backup_state"] = text


def _learning_rate(model):
    import keras

    return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


def test_a_folder_another_user_made_is_refused_and_nothing_in_it_is_loaded(tmp_path):
    planted = _a_real_backup(tmp_path / "theirs")
    with shared_folder() as base:
        shutil.copy(planted, f"{base}/planted.h5")
        os.chmod(f"{base}/planted.h5", 0o644)
        as_nobody(f"mkdir -m 0777 {base}/backup && cp {base}/planted.h5 "
                  f"{base}/backup/epoch-3.weights.h5")
        model = _model(lr=0.05)
        before = [w.copy() for w in model.get_weights()]
        with pytest.raises(PermissionError, match=(
                rf"BackupAndRestore: rank 0 refuses to read or write backups there: backup_dir "
                rf"'{base}/backup' belongs to another user \(uid 65534; you are uid 0\)\. Use a "
                rf"folder of your own")):
            _fit(model, _backup(f"{base}/backup"))
        for got, want in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(got, want)  # their weights were never loaded
        assert _learning_rate(model) == pytest.approx(0.05)
        assert os.path.exists(f"{base}/backup/epoch-3.weights.h5")  # nor anything deleted


def test_a_partial_file_link_another_user_plants_is_never_written_through(tmp_path):
    import keras

    victim = tmp_path / "victim"
    victim.write_text("precious")

    class Plant(keras.callbacks.Callback):  # mid-training, after fit's start-up cleaning
        def on_epoch_begin(self, epoch, logs=None):
            as_nobody(f"ln -s {victim} {base}/backup/.epoch-1.partial-{os.getpid()}.weights.h5")

    with shared_folder() as base:
        as_nobody(f"mkdir -m 0777 {base}/backup")
        with pytest.raises(PermissionError, match="belongs to another user"):
            _fit(_model(), Plant(), _backup(f"{base}/backup"))
        assert victim.read_text() == "precious"


def test_a_link_left_in_ones_own_folder_is_removed_not_written_through(tmp_path):
    import keras

    victim, folder = tmp_path / "victim", tmp_path / "backup"
    victim.write_text("precious")

    class Plant(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            os.symlink(victim, folder / f".epoch-1.partial-{os.getpid()}.weights.h5")

    _fit(_model(), Plant(), _backup(folder, delete_checkpoint=False))
    assert victim.read_text() == "precious"
    backup = folder / "epoch-1.weights.h5"
    assert stat.S_ISREG(os.lstat(backup).st_mode), "the backup is a file, not their link"
    assert stat.S_IMODE(os.lstat(backup).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def _assert_untouched(model, before):
    """The refused backup left the model as it was: the rate of _model() and `before`'s
    weights, bit for bit."""
    assert _learning_rate(model) == pytest.approx(0.1)
    for got, want in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("state, why", [
    ({"size": -2, "steps": 4}, r"size=-2, expected a whole number >= 1"),
    ({"size": 1.5, "steps": 4}, r"size=1.5, expected a whole number >= 1"),
    ({"size": 1, "steps": 4, "backup_dir": "/"}, r"unknown keys \['backup_dir'\]"),
    ({"size": 1, "steps": 4, "position": -8, "unit": "sample"}, r"position=-8"),
    ({"size": 1, "steps": 4, "position": 8, "unit": "../x"}, r"unit='../x'"),
    ("not json", r"its state is not JSON"),
])
def test_a_backup_whose_state_is_out_of_range_is_refused_and_the_rate_never_negative(
        tmp_path, state, why):
    # The issue planted size=-2: the rate became 0.1 * 1 / -2 and momentum flipped sign.
    path = _a_real_backup(tmp_path / "backup")
    _set_state(path, state if isinstance(state, str) else json.dumps(state))
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=rf"BackupAndRestore: refused the backup "
                                         rf"{path}: .*{why}.*Nothing of it was used"):
        _fit(model, _backup(tmp_path / "backup"), epochs=3)
    _assert_untouched(model, before)


def test_a_backup_with_a_learning_rate_that_is_not_finite_is_refused(tmp_path):
    import keras

    class Poison(keras.callbacks.Callback):  # runs before the backup of the epoch's end
        def on_epoch_end(self, epoch, logs=None):
            self.model.optimizer.learning_rate = math.nan

    _fit(_model(), Poison(), _backup(tmp_path / "backup", delete_checkpoint=False))
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"refused the backup .*epoch-1.weights.h5: the "
                                         r"restored learning rate is nan, expected a finite"):
        _fit(model, _backup(tmp_path / "backup"), epochs=3)
    _assert_untouched(model, before)
