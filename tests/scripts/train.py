"""Test worker: trains a small Dense model (no BatchNorm/Dropout) and saves each rank's weights.

    mgpu-train [-np N] train.py '<json config>' OUT_DIR
    mgpu-train [-np N] train.py '[<json config with "name">, ...]' OUT_DIR

A list runs each config in turn in this one job (one start-up of the framework), each on a
fresh model seeded anew, writing to OUT_DIR/<name>/.

Config keys: epochs, global_batch (samples per update, all ranks together), passes
(backward_passes_per_step), optimizer ("sgd" | "adam"), lr, op ("average" | "sum"),
compression, plain (no DistributedOptimizer: the 1-process reference), seed_per_rank
(different initial weights per rank), extra_units_on_rank1 (a different model on rank 1),
save_to / load_from (a .keras file), jit_compile.
Rank r's local data for update i is slice r of global batch i, so N ranks x batch b replay
exactly the batches that 1 process x batch N*b sees.
"""

import json
import os

import numpy as np

import mgpu_launch as mgpu
from mgpu_launch import runtime

mgpu.init()
import configs  # noqa: E402 - tests/scripts/configs.py: one config or several
import keras  # noqa: E402 - after init, as the README asks

import exact_math  # noqa: E402 - tests/scripts/exact_math.py: TF32 off on GPU sessions

exact_math.apply_if_asked(keras.backend.backend())

rank, size = mgpu.rank(), mgpu.size()


def train(config, out_dir):
    """Train as `config` says; writes OUT_DIR/rank.<rank>.npz and .json."""
    keras.utils.set_random_seed(7 + rank * config.get("seed_per_rank", 0))

    rng = np.random.default_rng(0)
    samples, features, classes = 96, 6, 3
    x = rng.normal(size=(samples, features)).astype("float32")
    y = rng.integers(0, classes, size=samples)

    per_update = config.get("global_batch", 8)
    chunk = per_update // size
    passes = config.get("passes", 1)
    local_batch = chunk // passes
    take = np.concatenate([np.arange(start + rank * chunk, start + (rank + 1) * chunk)
                           for start in range(0, samples, per_update)])
    x_local, y_local = x[take], y[take]

    if config.get("load_from"):
        model = mgpu.load_model(config["load_from"])
    else:
        units = 8 + (1 if config.get("extra_units_on_rank1") and rank == 1 else 0)
        model = keras.Sequential([keras.Input((features,)),
                                  keras.layers.Dense(units, activation="tanh"),
                                  keras.layers.Dense(classes)])
        lr = config.get("lr", 0.1)
        inner = (keras.optimizers.Adam(lr) if config.get("optimizer") == "adam"
                 else keras.optimizers.SGD(lr, momentum=0.9))
        optimizer = inner if config.get("plain") else mgpu.DistributedOptimizer(
            inner, op=mgpu.ReduceOp(config.get("op", "average")),
            compression=config.get("compression", "none"), backward_passes_per_step=passes)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=config.get("jit_compile", "auto"))

    history = model.fit(x_local, y_local, batch_size=local_batch,
                        epochs=config.get("epochs", 3), shuffle=False, verbose=0,
                        callbacks=[mgpu.callbacks.MetricAverageCallback()])
    if config.get("save_to") and mgpu.is_chief():
        model.save(config["save_to"])
    mgpu.barrier()
    np.savez(os.path.join(out_dir, f"rank.{rank}.npz"), *model.get_weights())
    with open(os.path.join(out_dir, f"rank.{rank}.json"), "w") as f:
        json.dump({"loss": history.history["loss"],
                   "optimizer": type(model.optimizer).__name__,
                   # Keras >= 3.16 on torch may wrap the model in DDP (it must not here).
                   "ddp_wrapper": type(getattr(model, "ddp_model", None)).__name__,
                   "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
                   # the transport the ranks met on (tests of starters without MPI check it)
                   "control_plane": (runtime.state.transport.name
                                     if runtime.is_multi_process() else None)}, f)
    print("trained", rank, history.history["loss"][-1])


configs.run_each(train)
