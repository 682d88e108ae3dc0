"""hvd.elastic.ObjectState and TensorFlowState (issue 39, item 2): Horovod's in-memory contract
(a snapshot at creation, commit and sync that restore() puts back) plus a commit on disk that
@hvd.elastic.run loads when a (restarted) job starts, read back as data. One process, no job;
the attacks run as user nobody against this (root) process."""

import io
import json
import os
import shutil

import numpy as np
import pytest

from conftest import BACKEND, as_nobody, shared_folder

pytestmark = pytest.mark.usefixtures("backend")


def _hvd():
    import mgpu_launch.keras as hvd

    return hvd


def _object_state(folder, **attributes):
    hvd = _hvd()
    return hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, backup_dir=str(folder),
                                   **attributes)


def _run(state):
    """@hvd.elastic.run over a function that records what it starts from."""
    calls = []

    @_hvd().elastic.run
    def train(state):
        calls.append({name: getattr(state, name) for name in state._names})

    train(state)
    return calls


def _commits(folder):
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))


def _rewrite(path, **changes):
    """Change a commit's JSON state (size, attributes) as someone editing the file would."""
    with np.load(path, allow_pickle=False) as store:
        entries = {name: store[name] for name in store.files}
    state = json.loads(str(entries["mgpu_state"]))
    for key, value in changes.items():
        if key == "size":
            state["size"] = value
        else:
            state["elastic_state"][key] = value
    entries["mgpu_state"] = np.array(json.dumps(state))
    buffer = io.BytesIO()
    np.savez(buffer, **entries)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())


def test_the_names_are_provided_where_horovod_has_them():
    import mgpu_launch.elastic
    import mgpu_launch.keras.elastic
    import mgpu_launch.tensorflow as tf_hvd

    from mgpu_launch.horovod.object_state import ObjectState

    # Refused with HorovodNotSupported before (issue 39, item 2).
    assert tf_hvd.elastic.ObjectState is ObjectState
    assert mgpu_launch.keras.elastic.ObjectState is ObjectState
    assert mgpu_launch.elastic.ObjectState is ObjectState
    assert issubclass(tf_hvd.elastic.TensorFlowState, ObjectState)
    assert {"ObjectState", "TensorFlowState"} <= set(tf_hvd.elastic.__all__)


def test_restore_undoes_every_change_since_creation_commit_or_sync(tmp_path):
    state = _object_state(tmp_path / "state", epoch=0, note="a", history=[1])
    state.epoch, state.note = 3, "b"
    state.history.append(2)  # changed in place: the snapshot is a copy
    assert state.restore() is None
    assert (state.epoch, state.note, state.history) == (0, "a", [1])
    assert not (tmp_path / "state").exists()  # creation and restore touch no disk
    state.epoch = 1
    state.commit()
    assert _commits(tmp_path / "state") == ["commit-1.npz"]
    shutil.rmtree(tmp_path / "state")  # restore() reads memory, not the commit's file
    state.epoch, state.history = 2, []
    state.restore()
    assert (state.epoch, state.history) == (1, [1])
    state.epoch = 4
    state.sync()  # one process: nothing to receive, and the snapshot moves here
    state.epoch = 5
    state.restore()
    assert state.epoch == 4


def test_run_starts_from_the_last_commit_and_deletes_the_commits_when_done(tmp_path):
    folder = tmp_path / "state"
    writer = _object_state(folder, epoch=0, best=0.0, tags={"a": [1]})
    for epoch in range(1, 4):
        writer.epoch, writer.best = epoch, epoch / 10
        writer.commit()
    assert _commits(folder) == ["commit-2.npz", "commit-3.npz"]  # the newest 2 are kept
    assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {"0o600"}
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    # The restarted job's script builds its state again, with its initial values.
    state = _object_state(folder, epoch=0, best=0.0, tags={})
    resets = []
    state.register_reset_callbacks([lambda: resets.append(state.epoch)])
    assert _run(state) == [{"epoch": 3, "best": 0.3, "tags": {"a": [1]}}]
    assert resets == []  # written by a job of this size
    assert not folder.exists()
    state.epoch = 7
    state.restore()  # the loaded commit is the snapshot
    assert state.epoch == 3


def test_a_commit_of_a_job_of_another_size_runs_the_reset_callbacks(tmp_path):
    folder = tmp_path / "state"
    _object_state(folder, epoch=2).commit()
    _rewrite(folder / "commit-1.npz", size=2)
    state = _object_state(folder, epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(state.epoch)])
    assert _run(state) == [{"epoch": 2}]
    assert resets == [2]  # after the restore, before train


def test_an_unreadable_newest_commit_falls_back_to_the_older_one(tmp_path):
    folder = tmp_path / "state"
    writer = _object_state(folder, epoch=0)
    for epoch in (1, 2):
        writer.epoch = epoch
        writer.commit()
    (folder / "commit-2.npz").write_bytes(b"not a zip file")  # a damaged write
    state = _object_state(folder, epoch=0)
    with pytest.warns(UserWarning, match=r"cannot read .*commit-2.npz.*trying an older"):
        assert _run(state) == [{"epoch": 1}]


@pytest.mark.parametrize("changes, why", [
    ({"backup_dir": "/"}, r"attributes this ObjectState does not declare: \['backup_dir'\]"),
    ({"epoch": "3"}, r"epoch='3', expected a number as declared \(0\)"),
    ({"note": ["not", "a", "string"]}, r"note=\['not', 'a', 'string'\], expected a string"),
    ({"size": 0}, r"size=0, expected a whole number >= 1"),
])
def test_a_commit_sets_only_declared_attributes_of_their_kind(tmp_path, changes, why):
    folder = tmp_path / "state"
    _object_state(folder, epoch=1, note="tiny").commit()
    _rewrite(folder / "commit-1.npz", **changes)  # in the user's own folder: a damaged commit
    state = _object_state(folder, epoch=0, note="")
    with pytest.raises(ValueError, match=rf"ObjectState: refused the commit .*commit-1.npz: "
                                         rf".*{why}"):
        _run(state)
    assert (state.epoch, state.note, state.backup_dir) == (0, "", str(folder))
    assert _commits(folder) == ["commit-1.npz"]  # refused, not deleted


def test_a_commit_with_a_pickle_inside_is_never_unpickled(tmp_path):
    folder = tmp_path / "state"
    _object_state(folder, epoch=1).commit()
    with np.load(folder / "commit-1.npz", allow_pickle=False) as store:
        entries = {name: store[name] for name in store.files}
    entries["mgpu_state"] = np.array([os.system], dtype=object)  # would need a pickle
    np.savez(folder / "commit-1.npz", **entries)
    state = _object_state(folder, epoch=0)
    # Refused by its header (an object array), before numpy's loader sees it (issue 51).
    with pytest.raises(ValueError, match=r"refused the commit .*commit-1.npz: its mgpu_state "
                                         r"entry is a object array of shape \(1,\), not one text"):
        _run(state)
    assert state.epoch == 0


def test_a_planted_commit_in_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    _object_state(tmp_path / "staging", epoch=5).commit()
    with shared_folder() as base:
        shutil.copy(tmp_path / "staging" / "commit-1.npz", f"{base}/planted.npz")
        os.chmod(f"{base}/planted.npz", 0o644)
        as_nobody(f"mkdir -m 0777 {base}/state && cp {base}/planted.npz "
                  f"{base}/state/commit-1.npz")
        monkeypatch.setenv("MGPU_ELASTIC_STATE_DIR", f"{base}/state")
        hvd = _hvd()
        state = hvd.elastic.ObjectState(epoch=0)
        with pytest.raises(PermissionError, match=(
                rf"ObjectState: rank 0 refuses to read or write commits there: backup_dir "
                rf"'{base}/state' belongs to another user \(uid 65534; you are uid 0\)")):
            _run(state)
        assert state.epoch == 0
        with pytest.raises(PermissionError, match="belongs to another user"):
            state.commit()
        assert os.listdir(f"{base}/state") == ["commit-1.npz"]


def test_attributes_that_are_not_json_data_fail_the_commit_and_nothing_is_written(tmp_path):
    state = _object_state(tmp_path / "state", epoch=0, best=0.0)
    state.epoch, state.best = 1, float("inf")
    with pytest.raises(ValueError, match=r"ObjectState.commit: best=inf, expected a finite "
                                         r"number; the attributes a commit writes must be JSON"):
        state.commit()
    state.best = {1: "int key"}
    with pytest.raises(ValueError, match=r"best has the key 1, not a string"):
        state.commit()
    state.best = object()
    with pytest.raises(ValueError, match=r"best holds a object, not JSON data"):
        state.commit()
    assert not (tmp_path / "state").exists()
    state.restore()
    assert (state.epoch, state.best) == (0, 0.0)  # the failed commits took no snapshot


def test_a_state_refuses_its_own_names_and_what_is_not_a_function():
    hvd = _hvd()
    for name in ("commit", "register_reset_callbacks", "_names"):
        with pytest.raises(ValueError, match=rf"ObjectState: the attribute names \['{name}'\] "
                                             rf"are the state's own"):
            hvd.elastic.ObjectState(**{name: 1})
    with pytest.raises(TypeError, match=r"ObjectState: bcast_object=0 is not callable"):
        hvd.elastic.ObjectState(0, epoch=0)
    with pytest.raises(TypeError, match=r"first argument is a dict, expected an hvd.elastic "
                                        r"state"):
        hvd.elastic.run(lambda state: None)({"epoch": 0})


# -- TensorFlowState ------------------------------------------------------------------------
tensorflow_only = pytest.mark.skipif(BACKEND != "tensorflow",
                                     reason="mgpu_launch.tensorflow is the TensorFlow backend's")


def _tf_state(folder, variables, **attributes):
    import mgpu_launch.tensorflow as hvd

    return hvd.elastic.TensorFlowState(variables, backup_dir=str(folder), **attributes)


@tensorflow_only
def test_tensorflow_state_refuses_sessions_and_what_is_not_a_variable():
    import tensorflow as tf

    import mgpu_launch.tensorflow as hvd

    with pytest.raises(ValueError, match=r"TensorFlowState: session=.* is a TF1 session; with "
                                         r"Keras 3 TensorFlow runs eagerly"):
        hvd.elastic.TensorFlowState([tf.Variable(1.0)], session=object(), batch=0)
    with pytest.raises(ValueError, match=r"variables=None tracks TF1's global-variable "
                                         r"collection"):
        hvd.elastic.TensorFlowState(batch=0)
    with pytest.raises(TypeError, match=r"variables\[1\] is a EagerTensor, not a variable"):
        hvd.elastic.TensorFlowState([tf.Variable(1.0), tf.constant(1.0)], batch=0)


@tensorflow_only
def test_tensorflow_state_restores_commits_and_loads_its_variables(tmp_path):
    import keras
    import tensorflow as tf

    folder = tmp_path / "state"
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    bfloat16 = tf.bfloat16.as_numpy_dtype  # ml_dtypes': numpy's file format does not know it
    extra = tf.Variable(np.arange(4, dtype="float32").reshape(2, 2).astype(bfloat16))
    variables = model.variables + opt.variables + [extra]
    state = _tf_state(folder, variables, batch=0)
    created = [np.array(v.numpy()) for v in variables]

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(np.ones((4, 3), "float32")) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        extra.assign_add(tf.ones((2, 2), tf.bfloat16))

    step()
    state.batch = 1
    state.restore()
    for variable, want in zip(variables, created):
        np.testing.assert_array_equal(variable.numpy(), want)
    assert state.batch == 0 and int(opt.iterations.numpy()) == 0
    step()
    state.batch = 1
    state.commit()
    committed = [np.array(v.numpy()) for v in variables]
    step()
    state.restore()
    for variable, want in zip(variables, committed):
        np.testing.assert_array_equal(variable.numpy(), want)
    # A restarted job: the same variables, other values; run() loads the commit.
    step()
    again = _tf_state(folder, variables, batch=0)
    assert _run(again) == [{"batch": 1}]
    for variable, want in zip(variables, committed):
        np.testing.assert_array_equal(variable.numpy(), want)
    assert extra.dtype == tf.bfloat16 and int(opt.iterations.numpy()) == 1


@tensorflow_only
def test_a_commit_of_other_variables_is_refused_and_changes_nothing(tmp_path):
    import tensorflow as tf

    folder = tmp_path / "state"
    _tf_state(folder, [tf.Variable(np.ones(3, "float32"))], batch=0).commit()
    for variables, why in (
            ([tf.Variable(np.zeros(4, "float32"))],
             r"v0 is float32 of shape \(3,\); variable 0 of the state is float32 of shape "
             r"\(4,\)"),
            ([tf.Variable(np.zeros(3, "float64"))], r"v0 is float32 .* is float64"),
            ([tf.Variable(np.zeros(3, "float32")), tf.Variable(1.0)],
             r"it holds the entries \['mgpu_state', 'v0'\], expected \['mgpu_state', 'v0', "
             r"'v1'\]")):
        state = _tf_state(folder, variables, batch=0)
        with pytest.raises(ValueError, match=rf"TensorFlowState: refused the commit "
                                             rf".*commit-1.npz: {why}"):
            _run(state)
        assert not variables[0].numpy().any() and state.batch == 0


# --- issue 51, item 4: a commit is checked by its headers before its data is read ----------


def _store_with_commit(folder, like):
    from mgpu_launch.horovod.elastic_store import CommitStore
    store = CommitStore(str(folder), "TensorFlowState")
    store.save({"epoch": 1, "best": 0.5}, like)
    return store, folder / "commit-1.npz"


def _replace_entry(path, name, npy_bytes, zeros=0):
    """Rewrite one entry of a commit as raw .npy bytes (header and data of one's choosing),
    followed by `zeros` zero bytes, streamed (this process never holds them)."""
    import zipfile
    with zipfile.ZipFile(path) as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    entries.pop(f"{name}.npy")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for entry, data in entries.items():
            archive.writestr(entry, data)
        with archive.open(f"{name}.npy", "w", force_zip64=True) as entry:
            entry.write(npy_bytes)
            chunk = bytes(1 << 20)
            for _ in range(zeros >> 20):
                entry.write(chunk)


def _npy(shape, dtype="<f4", data=b""):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue() + data


def _peak_rss_mb():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(store, like):
    return store.load_everywhere(lambda attributes: attributes, like)


def test_a_commit_is_refused_by_its_headers_before_its_data_is_read(tmp_path):
    # The attacker's equivalent here is whoever else writes in the job's own folder (the
    # folder check keeps other users out): what they plant must cost nothing to refuse.
    from mgpu_launch.training.epoch_resume import BadBackup
    like = [np.zeros((4, 3), np.float32)]
    store, path = _store_with_commit(tmp_path / "state", like)
    assert _load(store, like)[1] == {"epoch": 1, "best": 0.5}
    # A tiny file whose header claims 8 TiB: refused by the header, no MemoryError.
    _replace_entry(path, "v0", _npy((1 << 41,), data=b"\0" * 16))
    with pytest.raises(BadBackup, match=r"v0 is float32 of shape \(2199023255552,\); "
                                        r"variable 0 of the state is float32 of shape \(4, 3\)"):
        _load(store, like)
    # Half a GiB of zeros, compressed to half a MiB, of the wrong shape: never inflated.
    before = _peak_rss_mb()
    _replace_entry(path, "v0", _npy((8192, 16384)), zeros=8192 * 16384 * 4)
    assert path.stat().st_size < 2 << 20
    with pytest.raises(BadBackup, match=r"v0 is float32 of shape \(8192, 16384\)"):
        _load(store, like)
    assert _peak_rss_mb() - before < 200, "the refused commit's data was read"
    # The header's shape matches but the data is short or long: refused, not half-read.
    _replace_entry(path, "v0", _npy((4, 3), data=b"\0" * 4))
    with pytest.raises(BadBackup, match=r"v0 holds 4 bytes of data; its header says 48"):
        _load(store, like)


@pytest.mark.parametrize("text, why", [
    ('{"size": 1, "elastic_state": {"epoch": 1, "best": NaN}}', "NaN is not a number"),
    ('{"size": 1, "elastic_state": {"epoch": 1, "best": Infinity}}', "Infinity is not a number"),
    ('{"size": 1, "elastic_state": ' + "[" * 100000 + "]" * 100000 + "}",
     "nested deeper than 32 levels"),
])
def test_a_commits_state_text_with_nan_or_deep_nesting_is_refused(tmp_path, text, why):
    from mgpu_launch.training.epoch_resume import BadBackup
    like = [np.zeros((2,), np.float32)]
    store, path = _store_with_commit(tmp_path / "state", like)
    _replace_entry(path, "mgpu_state", _npy((), f"<U{len(text)}", text.encode("utf-32-le")))
    with pytest.raises(BadBackup, match=f"commit-1.npz: its state is refused: .*{why}"):
        _load(store, like)


@tensorflow_only
def test_a_commit_with_nan_is_refused_naming_the_variable_and_infinity_is_loaded_with_a_warning(
        tmp_path):
    """Issue 58, item 8: a NaN in a committed variable (a diverged step, a damaged file) is
    refused on every rank, naming the variable; Infinity is a value a variable may hold (a
    best loss not yet set): loaded, with a warning naming it."""
    import tensorflow as tf

    from mgpu_launch.training.epoch_resume import BadBackup
    folder = tmp_path / "state"
    weights = tf.Variable(np.ones((2, 2), "float32"), name="dense_kernel")
    best = tf.Variable(np.float32(np.inf), name="best_loss")
    count = tf.Variable(3, name="count")  # integers hold no NaN: not checked
    state = _tf_state(folder, [weights, best, count], batch=0)
    state.batch = 1
    state.commit()
    fresh = [tf.Variable(np.zeros((2, 2), "float32"), name="dense_kernel"),
             tf.Variable(np.float32(0), name="best_loss"), tf.Variable(0, name="count")]
    with pytest.warns(UserWarning, match=r"best_loss.*holds Infinity"):
        assert _run(_tf_state(folder, fresh, batch=0)) == [{"batch": 1}]
    assert np.isinf(fresh[1].numpy()) and int(fresh[2].numpy()) == 3
    weights.assign([[1.0, np.nan], [1.0, 1.0]])
    state.commit()
    before = np.array(fresh[0].numpy())
    with pytest.raises(BadBackup, match=r"variable 0 \(dense_kernel\S*\) holds NaN"):
        _run(_tf_state(folder, fresh, batch=0))
    np.testing.assert_array_equal(fresh[0].numpy(), before)  # nothing of it was used
