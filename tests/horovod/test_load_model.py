"""A model saved and loaded again keeps every option of its DistributedOptimizer: through
``mgpu.load_model`` and through ``hvd.load_model``, which wraps the loaded optimizer again
with another compression (issue 52: it used to copy 8 options by hand and drop cuda_graph,
process_set and scale_local_gradients)."""

import dataclasses

import pytest

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.backend

import numpy as np  # noqa: E402

import mgpu_launch as mgpu  # noqa: E402
import mgpu_launch.keras as hvd  # noqa: E402

#: every option away from its default, so that one dropped on the way shows (op excepted:
#: gradient_predivide_factor != 1 needs op=Average, the default)
CHANGED = dict(compression=mgpu.Compression.fp16, op=mgpu.Average, backward_passes_per_step=3,
               average_aggregated_gradients=False, gradient_predivide_factor=2.0,
               sparse_as_dense=True, cuda_graph=True, iterations_count="passes",
               process_set=mgpu.ProcessSet([0]), scale_local_gradients=False)
#: options that cannot join CHANGED: sharding the optimizer's state refuses a process set, so
#: it is saved and loaded in a case of its own (test_a_sharded_optimizer_loads_sharded)
ALONE = dict(shard_optimizer_state=True)


def test_the_changed_options_cover_every_option():
    from mgpu_launch.training.optimizer_options import DistributedOptions
    defaults = DistributedOptions()
    names = {field.name for field in dataclasses.fields(DistributedOptions)}
    assert set(CHANGED) | set(ALONE) == names and not set(CHANGED) & set(ALONE)
    assert [name for name, value in CHANGED.items() if getattr(defaults, name) == value] == [
        "op"]


def _saved(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1), name="dist", **CHANGED)
    model.compile(optimizer=optimizer, loss="mse")
    # not trained: a step would need the set registered, which one process cannot do (its
    # only set is the global one); the options are saved all the same
    path = str(tmp_path / "model.keras")
    model.save(path)
    return path, {name: getattr(optimizer, name) for name in CHANGED}


def _options(optimizer) -> dict:
    values = {name: getattr(optimizer, name) for name in CHANGED}
    values["compression"] = values["compression"].name
    values["process_set"] = getattr(values["process_set"], "ranks", None)
    return values


def test_mgpu_load_model_keeps_every_option(tmp_path):
    path, _ = _saved(tmp_path)
    loaded = mgpu.load_model(path).optimizer
    assert isinstance(loaded, mgpu.DistributedOptimizer) and loaded.name == "dist"
    assert _options(loaded) == dict(CHANGED, compression="fp16", process_set=[0])


def test_hvd_load_model_keeps_every_option_but_the_compression_it_is_given(tmp_path):
    path, _ = _saved(tmp_path)
    loaded = hvd.load_model(path, compression=hvd.Compression.bf16).optimizer
    assert isinstance(loaded, mgpu.DistributedOptimizer) and loaded.name == "dist"
    assert _options(loaded) == dict(CHANGED, compression="bf16", process_set=[0])


def test_a_sharded_optimizer_loads_sharded(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.Adam(0.1), name="dist",
                                                      **ALONE), loss="mse")
    model.fit(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    for loaded in (mgpu.load_model(path).optimizer, hvd.load_model(path).optimizer):
        assert isinstance(loaded, mgpu.DistributedOptimizer) and loaded.name == "dist"
        assert {name: getattr(loaded, name) for name in ALONE} == ALONE

