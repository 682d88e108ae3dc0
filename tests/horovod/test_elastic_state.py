"""hvd.elastic's state folder is data, never instructions (issue 37, item 1): a state another
user planted is refused, and nothing restored names a folder mgpu deletes. The attacks run as
user nobody against this (root) process; one process, no job. And Horovod's in-memory
semantics (issue 39, item 2): restore() undoes what changed since the last commit, sync or the
state's creation."""

import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from conftest import as_nobody, shared_folder

pytestmark = pytest.mark.usefixtures("backend")


def _model():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _state(folder=None, **attributes):
    import mgpu_launch.keras as hvd

    return hvd.elastic.KerasState(_model(), backup_dir=folder, **attributes)


def _commit(folder, **changes):
    """A real commit in `folder` (epoch 1, batch 2, note "tiny"), its attributes then changed
    to `changes`; returns its path."""
    import h5py

    state = _state(str(folder), epoch=1, batch=2, note="tiny")
    state.commit()
    path = os.path.join(folder, "epoch-1-batch-2.weights.h5")
    with h5py.File(path, "a") as store:
        saved = json.loads(store.attrs["mgpu_backup_state"])
        saved["elastic_state"].update(changes)
        store.attrs["mgpu_backup_state"] = json.dumps(saved)
    return path


@pytest.fixture
def victim():
    """A folder of root's in /tmp that a planted state names (removed afterwards)."""
    folder = tempfile.mkdtemp(prefix="mgpu-victim-", dir="/tmp")
    with open(os.path.join(folder, "precious"), "w") as f:
        f.write("precious")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _train(state):
    import mgpu_launch.keras as hvd

    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append((state.epoch, state.batch))

    train(state)
    return calls


def test_a_planted_state_in_a_world_writable_folder_is_refused_and_deletes_nothing(
        tmp_path, monkeypatch, victim):
    # The attack: MGPU_ELASTIC_STATE_DIR writable by all, a commit naming a folder
    # of root's as backup_dir; the wrapper deleted it when train() returned.
    planted = _commit(tmp_path / "staging", backup_dir=victim)
    with shared_folder() as base:
        shutil.copy(planted, f"{base}/planted.h5")
        os.chmod(f"{base}/planted.h5", 0o644)
        as_nobody(f"mkdir -m 0777 {base}/state && cp {base}/planted.h5 "
                  f"{base}/state/epoch-1-batch-2.weights.h5")
        monkeypatch.setenv("MGPU_ELASTIC_STATE_DIR", f"{base}/state")
        state = _state(epoch=0, batch=0)
        with pytest.raises(PermissionError, match=(
                rf"refuses to read or write backups there: backup_dir '{base}/state' belongs "
                rf"to another user \(uid 65534; you are uid 0\)")):
            _train(state)
        assert (state.epoch, state.batch) == (0, 0)
        assert os.path.exists(f"{base}/state/epoch-1-batch-2.weights.h5")
    assert open(os.path.join(victim, "precious")).read() == "precious"


@pytest.mark.parametrize("changes, why", [
    ({"backup_dir": "VICTIM"}, r"attributes this KerasState does not declare: \['backup_dir'\]"),
    ({"epoch": -1}, r"epoch=-1, expected a whole number >= 0"),
    ({"batch": 2.5}, r"batch=2.5, expected a whole number >= 0"),
    ({"note": ["not", "a", "string"]}, r"note=\['not', 'a', 'string'\], expected a string"),
])
def test_a_commit_sets_only_declared_attributes_of_their_kind(tmp_path, victim, changes, why):
    changes = {name: victim if value == "VICTIM" else value for name, value in changes.items()}
    _commit(tmp_path / "state", **changes)  # in the user's own folder: a damaged commit
    state = _state(str(tmp_path / "state"), epoch=0, batch=0, note="")
    with pytest.raises(ValueError, match=rf"BackupAndRestore: refused the backup "
                                         rf".*epoch-1-batch-2.weights.h5: .*{why}"):
        _train(state)
    assert state.backup_dir == str(tmp_path / "state") and state.note == ""
    assert open(os.path.join(victim, "precious")).read() == "precious"


def test_a_good_commit_is_restored_and_only_its_own_folder_deleted(tmp_path):
    _commit(tmp_path / "state")
    state = _state(str(tmp_path / "state"), epoch=0, batch=0, note="")
    assert _train(state) == [(1, 2)] and state.note == "tiny"
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("name", ["params", "restore", "_names"])
def test_an_attribute_may_not_take_a_name_of_the_state_itself(name):
    with pytest.raises(ValueError, match=rf"the attribute names \['{name}'\] are the state's "
                                         rf"own"):
        _state(None, **{name: 1})


def _momentum_model():
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def _state_values(model):
    """Every weight and optimizer variable (iterations, momentum slots), as numpy arrays."""
    import keras

    return [keras.ops.convert_to_numpy(v).copy()
            for v in model.weights + model.optimizer.variables]


def _train_one_batch(model):
    model.fit(np.ones((4, 3), "float32"), np.zeros((4, 2), "float32"), batch_size=4,
              epochs=1, verbose=0)


def _assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_restore_before_any_commit_undoes_the_changes_since_creation(tmp_path):
    # Horovod's semantics (issue 39, item 2): the state is snapshotted when it is created, so
    # restore() undoes uncommitted changes even before the first commit.
    import mgpu_launch.keras as hvd

    model = _momentum_model()
    state = hvd.elastic.KerasState(model, backup_dir=str(tmp_path / "state"), epoch=0,
                                   note="a", history=[1])
    created = _state_values(model)
    _train_one_batch(model)
    state.epoch, state.batch, state.note = 3, 7, "b"
    state.history.append(2)  # changed in place: the snapshot is a copy
    assert not all(np.array_equal(a, b) for a, b in zip(_state_values(model), created))
    assert state.restore() is None
    _assert_same(_state_values(model), created)  # weights, iterations 0, momentum zeros
    assert (state.epoch, state.batch, state.note, state.history) == (0, 0, "a", [1])
    assert not (tmp_path / "state").exists()  # nothing was written or read on disk


def test_restore_returns_to_the_last_commit_or_sync_from_memory(tmp_path):
    import mgpu_launch.keras as hvd

    model = _momentum_model()
    state = hvd.elastic.KerasState(model, backup_dir=str(tmp_path / "state"), epoch=0)
    _train_one_batch(model)
    state.epoch = 1
    state.commit()
    committed = _state_values(model)
    shutil.rmtree(tmp_path / "state")  # restore() reads memory, not the commit's file
    _train_one_batch(model)
    state.epoch = 2
    state.restore()
    _assert_same(_state_values(model), committed)
    assert state.epoch == 1
    _train_one_batch(model)
    state.epoch = 4
    state.sync()  # one process: nothing to receive, and the snapshot moves here
    synced = _state_values(model)
    _train_one_batch(model)
    state.epoch = 5
    state.restore()
    _assert_same(_state_values(model), synced)
    assert state.epoch == 4
