"""The optimizer state sharded across ranks (issue 60): who owns what, what is refused, a
custom loop and fit's callbacks on a sharded optimizer, its refused save.

The exactness of the sharded update against the unsharded one (the matrix's optimizers,
clipping, accumulation, mixed precision, np=2 and 4) and the bytes each rank holds are in
tests/test_exactness_matrix.py (``test_sharded_state_*``).
"""

import os
import random

import numpy as np
import pytest

from conftest import BACKEND, SCRIPTS, launch_ok, requires_mpirun
from mgpu_launch.training import sharding


# -- ownership: pure arithmetic ------------------------------------------------------------------
def test_largest_first_onto_the_least_loaded_rank():
    assert sharding.assign_owners([10, 3, 3, 4], 2) == [0, 1, 1, 1]
    assert sharding.assign_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert sharding.assign_owners([1, 2, 3], 1) == [0, 0, 0]


def test_every_rank_owns_one_and_none_holds_more_than_its_share_plus_the_largest():
    rng = random.Random(7)
    for _ in range(200):
        ranks = rng.randint(1, 8)
        sizes = [rng.choice([1, 8, 64, 4096, 10 ** 6]) for _ in range(rng.randint(ranks, 40))]
        owners = sharding.assign_owners(sizes, ranks)
        assert owners == sharding.assign_owners(list(sizes), ranks)  # the same on every rank
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(ranks)]
        assert set(owners) == set(range(ranks)), (sizes, owners)
        assert max(loads) <= sum(sizes) / ranks + max(sizes), (sizes, loads)


def test_a_variable_larger_than_a_share_fills_one_rank_alone():
    # The documented limit of per-variable ownership (an embedding of 90% of the model).
    owners = sharding.assign_owners([900, 30, 30, 40], 4)
    assert owners[0] not in owners[1:]


def test_ranks_of_nothing_are_refused():
    with pytest.raises(ValueError, match="ranks=0"):
        sharding.assign_owners([1], 0)


# -- what is refused at construction (the same on every rank: no collective) ---------------------
@pytest.mark.backend
@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("name", sharding.SHARDABLE)
def test_kerass_per_variable_optimizers_are_accepted(name):
    import keras

    import mgpu_launch as mgpu

    inner = getattr(keras.optimizers, name)(learning_rate=0.01)
    optimizer = mgpu.DistributedOptimizer(inner, shard_optimizer_state=True)
    assert optimizer.shard_optimizer_state and optimizer.options.shard_optimizer_state
    config = optimizer.get_config()
    assert config["shard_optimizer_state"] is True
    again = mgpu.DistributedOptimizer.from_config(config)
    assert again.shard_optimizer_state


def _refusals():
    import keras

    class CustomAdam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            super().update_step(gradient, variable, learning_rate)

    return {
        "custom subclass": (CustomAdam(0.01), "not one of Keras's per-variable optimizers"),
        "schedule-free": (keras.optimizers.ScheduleFreeAdamW(0.01), "ScheduleFreeAdamW"),
        "ema": (keras.optimizers.Adam(0.01, use_ema=True), "use_ema=True"),
        "global clipping under a loss scaler": (
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1, global_clipnorm=1.0)),
            "global_clipnorm=1.0 and a LossScaleOptimizer"),
        "global clipping after Keras's accumulation": (
            keras.optimizers.SGD(0.1, global_clipnorm=1.0, gradient_accumulation_steps=2),
            "gradient_accumulation_steps"),
    }


@pytest.mark.backend
@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("case", ["custom subclass", "schedule-free", "ema",
                                  "global clipping under a loss scaler",
                                  "global clipping after Keras's accumulation"])
def test_an_optimizer_that_cannot_be_sharded_is_refused_with_the_reason(case):
    import mgpu_launch as mgpu

    inner, reason = _refusals()[case]
    with pytest.raises(ValueError, match="shard_optimizer_state=True") as error:
        mgpu.DistributedOptimizer(inner, shard_optimizer_state=True)
    assert reason in str(error.value)
    mgpu.DistributedOptimizer(inner)  # unsharded, the same optimizer is fine


@pytest.mark.backend
@pytest.mark.usefixtures("backend")
def test_horovods_keyword_reaches_the_optimizer():
    import keras

    import mgpu_launch.keras as hvd

    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True)
    assert optimizer.shard_optimizer_state
    with pytest.raises(ValueError, match="use_ema"):
        hvd.DistributedOptimizer(keras.optimizers.Adam(0.01, use_ema=True),
                                 shard_optimizer_state=True)


@pytest.mark.backend
@pytest.mark.usefixtures("backend")
def test_one_process_holds_the_whole_state_and_trains_as_keras():
    import keras

    import mgpu_launch as mgpu

    def fit(optimizer):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(optimizer=optimizer, loss="mse")
        rng = np.random.default_rng(0)
        model.fit(rng.normal(size=(16, 4)), rng.normal(size=(16, 3)), batch_size=4, verbose=0)
        return model.get_weights()

    ours = mgpu.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True)
    for a, b in zip(fit(ours), fit(keras.optimizers.Adam(0.01)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not ours.holds_sharded_state()  # one rank owns everything: nothing is split
    assert sharding.state_bytes(ours) == sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in ours.inner_optimizer.variables)


# -- a job: a custom loop and fit, sharded; saved and loaded every way ---------------------------
@requires_mpirun
@pytest.mark.backend
@pytest.mark.job
@pytest.mark.usefixtures("backend")
def test_a_custom_loop_fit_and_every_way_to_save_and_load_a_sharded_state(tmp_path):
    import keras

    launch_ok("-np", "2", os.path.join(SCRIPTS, "sharded_loop.py"), str(tmp_path), timeout=900,
              KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    keys = sorted(k for k in ranks[0] if k != "state_bytes")
    for key in keys:  # every rank holds the same weights, bit for bit
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    weights = ranks[0]
    count = sum(1 for k in keys if k.startswith("continued_"))
    for i in range(count):
        # the custom loop (AdamW, global_clipnorm): sharded equals unsharded
        np.testing.assert_array_equal(weights[f"loop_plain_{i}"], weights[f"loop_sharded_{i}"])
        # one more epoch from the saved state, loaded on every rank (from a sharded file and
        # from an unsharded one, re-sharded) or restored by BackupAndRestore from rank 0's
        # backup: the weights of the run that went on
        for way in ("from_sharded", "from_plain", "restored"):
            np.testing.assert_array_equal(weights[f"{way}_{i}"], weights[f"continued_{i}"],
                                          err_msg=f"{way} weight #{i}")
    assert all(int(r["state_bytes"]) > 0 for r in ranks)
    # Written by a sharded job, loaded by plain Keras with the whole state: the unsharded
    # twin's optimizer variables, bit for bit.
    loaded = keras.saving.load_model(tmp_path / "sharded.keras")
    with np.load(tmp_path / "plain_state.npz") as saved:
        expected = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    state = [keras.ops.convert_to_numpy(v.value) for v in loaded.optimizer.variables]
    assert len(state) == len(expected) > 2, (len(state), len(expected))
    for index, (ours, theirs) in enumerate(zip(state, expected)):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"optimizer variable #{index}")
    # BackupAndRestore at another number of ranks (3, and 1: unsharded) re-shards the backup;
    # gathered again, it is the same state (the rate scaled by the new size, rescale_lr)
    newest, = (tmp_path / "backups").glob("epoch-*.weights.h5")  # keep=1
    backup = _optimizer_state(keras, newest)
    for ranks in (3, 1):
        launch_ok("-np", str(ranks), os.path.join(SCRIPTS, "sharded_loop.py"), str(tmp_path),
                  "reshard", timeout=900, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
        again = _optimizer_state(keras, tmp_path / "resharded.weights.h5")
        assert sorted(again) == sorted(backup), ranks
        for name, value in backup.items():
            scale = ranks / 2 if name == "learning_rate" else 1
            np.testing.assert_array_equal(again[name], value * scale, err_msg=f"{ranks}: {name}")


def _optimizer_state(keras, path):
    """The optimizer variables a weights file holds, by name, as plain Keras reads them."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)],
                             name="probe")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    names = ["kernel_0", "bias_0", "kernel_1", "bias_1", "kernel_2", "bias_2"]
    state = {}
    for variable in model.optimizer.variables:  # slot names carry this process's layer names
        name = variable.name
        for index, weight in enumerate(model.trainable_variables):
            prefix = weight.path.replace("/", "_") + "_"
            if name.startswith(prefix):
                name = names[index] + "_" + name[len(prefix):]
        state[name] = keras.ops.convert_to_numpy(variable.value)
    return state
