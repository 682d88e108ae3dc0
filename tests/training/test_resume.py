"""Resume after a kill: a restarted job ends with the weights of an uninterrupted one."""

import json
import os

import numpy as np
import pytest

from conftest import BACKEND, SCRIPTS, assert_ok, explain, launch, rank_weights, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.usefixtures("backend")]

RESUME = os.path.join(SCRIPTS, "resume.py")
ENV = {"KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "2"}


def run(backup, out, *kill):
    return launch("-np", "2", RESUME, str(backup), str(out), *kill, timeout=180, **ENV)


@pytest.mark.first_backend
@pytest.mark.job
def test_killed_mid_epoch_then_restarted_equals_uninterrupted(tmp_path, resume_reference):
    reference, reference_backup = resume_reference  # tests/conftest.py: the uninterrupted run
    (tmp_path / "resumed").mkdir()
    assert not reference_backup.exists()  # removed after a normal finish

    killed = run(tmp_path / "backup", tmp_path / "resumed", "2")
    assert killed.returncode != 0
    # Epochs 0 and 1 finished: the backup to resume from is the one before epoch 2.
    assert os.listdir(tmp_path / "backup") == ["epoch-2.weights.h5"], explain(killed)

    resumed = assert_ok(run(tmp_path / "backup", tmp_path / "resumed"))
    assert "resuming at epoch 3" in resumed.stdout
    expected, got = rank_weights(reference), rank_weights(tmp_path / "resumed")
    for rank in range(2):
        for a, b in zip(got[rank], expected[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def run_steps(backup, out, *kill):
    return launch("-np", "2", os.path.join(SCRIPTS, "resume_steps.py"), str(backup), str(out),
                  *kill, timeout=180, **ENV)


@pytest.mark.job
def test_killed_mid_epoch_resumes_at_the_backed_up_batch(tmp_path, resume_steps_reference):
    # resume_steps_reference (tests/conftest.py): the uninterrupted run, shared with test_restart
    (tmp_path / "resumed").mkdir()
    killed = run_steps(tmp_path / "backup", tmp_path / "resumed", "1", "4")
    assert killed.returncode != 0
    # Every 3 batches and every epoch end, newest 2 kept: epoch 1's batch-3 backup and
    # epoch 0's end (the kill came after batch index 4, before the next backup at 6).
    assert sorted(os.listdir(tmp_path / "backup")) == [
        "epoch-1-batch-3.weights.h5", "epoch-1.weights.h5"], explain(killed)
    partial = tmp_path / "backup" / ".epoch-1-batch-6.partial-99999.weights.h5"
    partial.write_bytes(b"half a file")  # what a rank 0 killed mid-write leaves

    resumed = assert_ok(run_steps(tmp_path / "backup", tmp_path / "resumed"))
    assert "resuming at epoch 2, batch 4" in resumed.stdout
    for rank in range(2):
        info = json.loads((tmp_path / "resumed" / f"rank.{rank}.json").read_text())
        assert info["iterations"] == 24  # 3 epochs x 8 batches, none run twice or skipped
        assert info["steps"][0] == [1, 3] and len(info["steps"]) == 24 - 11
    expected, got = rank_weights(resume_steps_reference), rank_weights(tmp_path / "resumed")
    for rank in range(2):
        for a, b in zip(got[rank], expected[0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_partial_files_of_a_killed_writer_are_removed_and_only_the_newest_kept(tmp_path):
    import keras

    import mgpu_launch as mgpu

    backup = tmp_path / "backup"
    backup.mkdir()
    (backup / ".epoch-3-batch-2.partial-4242.weights.h5").write_bytes(b"half a file")
    (backup / "notes.txt").write_text("not ours: left alone")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((24, 3), "float32"), np.zeros((24, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[
        mgpu.callbacks.BackupAndRestore(str(backup), save_freq=2, keep=2,
                                        delete_checkpoint=False)])
    # 6 batches: backups after batches 2 and 4 and at the epoch's end; the newest 2 stay.
    assert sorted(os.listdir(backup)) == ["epoch-0-batch-4.weights.h5", "epoch-1.weights.h5",
                                          "notes.txt"]


@pytest.mark.parametrize("bad", [{"save_freq": 0}, {"save_freq": "batch"}, {"keep": 0}])
def test_bad_arguments_say_what_is_expected(tmp_path, bad):
    import mgpu_launch as mgpu

    with pytest.raises(ValueError, match="expected"):
        mgpu.callbacks.BackupAndRestore(str(tmp_path), **bad)


def test_one_process_interrupted_mid_epoch_then_resumed_equals_uninterrupted(tmp_path):
    import keras

    import mgpu_launch as mgpu

    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(48, 3)).astype("float32"), rng.normal(size=(48, 2)).astype("float32")

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 7):
                raise KeyboardInterrupt("interrupted")

    def train(*callbacks):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
        model.fit(mgpu.data.shard((x, y), batch_size=4, shuffle=True, seed=2), epochs=2,
                  shuffle=False, verbose=0, callbacks=list(callbacks))
        return model

    expected = train().get_weights()
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        train(mgpu.callbacks.BackupAndRestore(backup, save_freq=5), Interrupt())
    assert os.listdir(backup) == ["epoch-1-batch-5.weights.h5"]
    resumed = train(mgpu.callbacks.BackupAndRestore(backup, save_freq=5))
    assert int(keras.ops.convert_to_numpy(resumed.optimizer.iterations)) == 24
    for a, b in zip(resumed.get_weights(), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _tiny_fit(callbacks):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((16, 3), "float32"), np.zeros((16, 2), "float32")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)


def test_a_backup_folder_rank_0_cannot_write_fails_before_the_first_step(tmp_path):
    import keras

    import mgpu_launch as mgpu

    class Steps(keras.callbacks.Callback):
        taken = 0

        def on_train_batch_begin(self, batch, logs=None):
            Steps.taken += 1

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for folder, why in ((blocker, "it exists and is not a folder"),
                        (blocker / "backup", "NotADirectoryError: Not a directory")):
        backup = mgpu.callbacks.BackupAndRestore(str(folder), save_freq=1000)
        with pytest.raises(OSError, match=f"BackupAndRestore: rank 0 cannot keep backups in "
                                          f"'{folder}': {why}. Expected a folder"):
            _tiny_fit([backup, Steps()])
    assert Steps.taken == 0


def test_an_epoch_backup_leaves_keras_batch_end_dispatch_alone(tmp_path):
    import threading

    import keras

    import mgpu_launch as mgpu

    class Where(keras.callbacks.Callback):
        async_safe = True  # Keras may run it on its callback thread

        def __init__(self):
            super().__init__()
            self.on_main_thread = set()

        def on_train_batch_end(self, batch, logs=None):
            self.on_main_thread.add(threading.current_thread() is threading.main_thread())

    default = keras.callbacks.Callback.on_train_batch_end
    per_epoch = mgpu.callbacks.BackupAndRestore(str(tmp_path / "epoch"))
    per_steps = mgpu.callbacks.BackupAndRestore(str(tmp_path / "steps"), save_freq=2)
    # Keras dispatches batch ends asynchronously (JAX, torch) only while no callback
    # overrides on_train_batch_end.
    assert per_epoch.on_train_batch_end.__func__ is default
    assert per_steps.on_train_batch_end.__func__ is not default
    asynchronous = keras.backend.backend() in ("jax", "torch")
    for backup, main_thread in ((per_epoch, not asynchronous), (per_steps, True)):
        where = Where()
        _tiny_fit([backup, where])
        assert where.on_main_thread == {main_thread}, backup.save_freq
