"""Test worker for tests/test_exactness_matrix.py: many small models in one job, each trained
twice, so one process group per backend covers the whole matrix.

    mgpu-train -np N exactness.py '<json list of case names>' OUT_DIR

For every case, in order: every rank trains the case's model through a DistributedOptimizer on
its own part of each global batch and writes ``<case>.rank<r>.npz``; and one rank (case index
modulo the number of ranks, so the ranks share the work) trains the same model from the same
weights with the plain optimizer on the whole global batch, in this process alone (no
collective), and writes ``<case>.reference.npz``: the single-process result every rank must
match. A case with ``ranks_as_passes`` also gets ``<case>.accumulated.npz``: one process
accumulating the ranks' batches one after the other with Keras's gradient_accumulation_steps
(mixed precision: the same float16 sums as the ranks'). Each npz also holds ``iterations`` and
``learning_rate`` (the optimizer's, read after training) under those keys.

Environment (set by the tests or by hand on a GPU machine):
    EXACTNESS_FP32=1          full float32 and deterministic kernels on GPUs (exact_math.py)
    EXACTNESS_STATIC_ONLY=1   TensorFlow: fail if a sparse gradient takes the dynamic gather
                              (the test that the XLA-compatible path is the one that ran)
    EXACTNESS_SHARD=1         every rank also trains each case with shard_optimizer_state=True
                              and writes ``<case>.sharded.rank<r>.npz`` (issue 60)

Every rank's npz also holds ``state_bytes``: the bytes of optimizer state that rank held
(``mgpu_launch.training.sharding.state_bytes``).
"""

import json
import os
import sys
import zlib

import numpy as np

import mgpu_launch as mgpu
from mgpu_launch.training import sharding

mgpu.init()
import keras  # noqa: E402 - after init, as the README asks

import exact_math  # noqa: E402 - tests/scripts/exact_math.py, beside this worker
import exactness_hub  # noqa: E402 - the keras-hub cases, beside this worker


def forbid_dynamic_gather() -> None:
    """EXACTNESS_STATIC_ONLY=1: the dynamic (not XLA-compilable) gather raises if reached."""
    from mgpu_launch.backends.tensorflow import collectives as tensorflow_collectives

    def refused(engine, tensors):
        raise AssertionError("the dynamic allgather ran; MGPU_TF_SPARSE_GATHER=static expected "
                             "the fixed-size gather")
    tensorflow_collectives.allgather_rows = refused


exact_math.apply_if_asked(keras.backend.backend())
if os.environ.get("EXACTNESS_STATIC_ONLY") == "1":
    forbid_dynamic_gather()

STEPS = 4          # updates per case
GLOBAL_BATCH = 8   # samples per update, all ranks together


# -- the models -------------------------------------------------------------------------------
def mlp():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3, dtype="float32")])


def embedding():
    return keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 8),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


def embedding_int64():
    # int64 ids all the way to the Embedding, so its IndexedSlices carry int64 indices: what a
    # subclassed model sees on a GPU, where mgpu's prefetch widens int32 batches to int64.
    return keras.Sequential([keras.Input((5,), dtype="int64"), keras.layers.Embedding(20, 8),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


def transformer():
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8)(tokens)
    # No projection biases: the key's bias has a zero gradient in exact arithmetic (softmax
    # ignores what it adds to every logit of a query), so its float gradient is rounding noise
    # that Adam scales up to lr * noise / epsilon, and the noise follows the order of every sum.
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, use_bias=False)(h, h)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, attended]))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(3)(h))


def dense_3d():
    # A Dense on 3-D inputs: on TensorFlow its kernel's gradient has static shape (None, 16)
    # when the batch size is unknown (issue 48: every transformer's feed-forward).
    return keras.Sequential([keras.Input((6, 8)), keras.layers.Dense(16),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


def lstm():
    return keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(6), keras.layers.Dense(3)])


def vision(synchronized=False):
    # Synchronized BatchNorm after a convolution (issue 25 item 3); the single-process reference
    # is the same model with plain BatchNormalization (the statistics of its whole batch).
    return keras.Sequential([
        keras.Input((5, 5, 3)), keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5),
        keras.layers.ReLU(), keras.layers.Flatten(), keras.layers.Dense(3)])


def decaying():
    # A different rate at every backward pass: the update uses the one at the pass it runs in.
    return keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=1, decay_rate=0.8)


#: name -> model, inputs, optimizer (a factory; its keyword arguments go to the Keras optimizer),
#: options. passes: the DistributedOptimizer's backward_passes_per_step and the reference's
#: gradient_accumulation_steps (Keras's own); policy: the dtype policy; loss_scale: wrap the
#: optimizer in a LossScaleOptimizer; ranks_as_passes: a second reference, Keras's own
#: accumulation over the ranks' batches one after the other (<case>.accumulated.npz);
#: synchronized: the model takes synchronized=True on the ranks, False for the references.
CASES = {
    "sgd_momentum": dict(model=mlp, inputs="dense",
                         optimizer=lambda **kw: keras.optimizers.SGD(0.1, momentum=0.9, **kw)),
    "adam": dict(model=mlp, inputs="dense",
                 optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
    "adamw": dict(model=mlp, inputs="dense",
                  optimizer=lambda **kw: keras.optimizers.AdamW(0.01, weight_decay=0.1, **kw)),
    "rmsprop": dict(model=mlp, inputs="dense",
                    optimizer=lambda **kw: keras.optimizers.RMSprop(0.01, momentum=0.5, **kw)),
    # Both clip (gradient norms here are 0.3 - 1): on the averaged gradient, as 1 process does.
    "clipnorm": dict(model=mlp, inputs="dense", optimizer=lambda **kw: keras.optimizers.SGD(
        0.1, momentum=0.9, clipnorm=0.05, **kw)),
    "global_clipnorm": dict(model=mlp, inputs="dense", optimizer=lambda **kw: keras.optimizers.SGD(
        0.1, momentum=0.9, global_clipnorm=0.05, **kw)),
    "embedding_adam": dict(model=embedding, inputs="tokens5",
                           optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
    "embedding_int64_ids": dict(model=embedding_int64, inputs="tokens5", ids="int64",
                                optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
    "transformer_adamw": dict(model=transformer, inputs="tokens6",
                              optimizer=lambda **kw: keras.optimizers.AdamW(
                                  0.01, weight_decay=0.05, **kw)),
    "lstm": dict(model=lstm, inputs="sequence",
                 optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
    "accumulation": dict(model=mlp, inputs="dense", passes=2,
                         optimizer=lambda **kw: keras.optimizers.Adam(decaying(), **kw)),
    "mixed_bfloat16": dict(model=mlp, inputs="dense", policy="mixed_bfloat16", ranks_as_passes=True,
                           optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
    "mixed_float16": dict(model=mlp, inputs="dense", policy="mixed_float16", loss_scale=True,
                          ranks_as_passes=True,
                          optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
    # Inputs 50x larger: the first kernel's gradient overflows float16 at the first steps, the
    # others' not, so a loss scaler skips steps because of one variable (with the optimizer
    # state sharded, one rank's part: every rank must skip alike).
    # (Keras's own accumulation skips per pass, so it is no reference here: ranks_as_passes off.)
    "mixed_float16_overflow": dict(model=mlp, inputs="dense_x50", policy="mixed_float16",
                                   loss_scale=True,
                                   optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
    "vision_sync_bn": dict(model=vision, inputs="image", synchronized=True,
                           optimizer=lambda **kw: keras.optimizers.SGD(0.1, momentum=0.9, **kw)),
    # The README's recipe: mgpu.data.shard of arrays (Keras's adapter: an unknown batch size).
    "dense_3d_shard": dict(model=dense_3d, inputs="sequence_6x8", feed="shard",
                           optimizer=lambda **kw: keras.optimizers.Adam(0.01, **kw)),
}
# keras-hub transformers, each fed three ways (tests/scripts/exactness_hub.py)
for _name, (_model, _feed) in exactness_hub.cases().items():
    CASES[_name] = dict(model=exactness_hub.MODELS[_model], inputs=f"hub:{_model}", feed=_feed,
                        optimizer=lambda **kw: keras.optimizers.AdamW(
                            0.01, weight_decay=0.05, epsilon=exactness_hub.EPSILON, **kw))


#: the cases whose seed is their place in this sorted list (the matrix's first 13 cases, as
#: their data and weights have always been drawn); later cases get a seed from their name, so
#: adding a case never redraws the others'
_FIRST_CASES = sorted(["sgd_momentum", "adam", "adamw", "clipnorm", "global_clipnorm",
                       "embedding_adam", "embedding_int64_ids", "transformer_adamw", "lstm",
                       "accumulation", "mixed_bfloat16", "mixed_float16", "vision_sync_bn"])


def case_seed(name: str) -> int:
    if name in _FIRST_CASES:
        return _FIRST_CASES.index(name)
    return 1000 + zlib.crc32(name.encode()) % 100000


def inputs(kind, samples, rng):
    if kind == "dense":
        x = rng.normal(size=(samples, 6))
    elif kind == "dense_x50":
        x = rng.normal(size=(samples, 6)) * 50.0
    elif kind == "sequence":
        x = rng.normal(size=(samples, 5, 3))
    elif kind == "sequence_6x8":
        x = rng.normal(size=(samples, 6, 8))
    elif kind == "image":  # a mean far from zero against the spread, as images have
        x = rng.normal(size=(samples, 5, 5, 3)) * 2.0 + 3.0
    else:  # tokens<length>: few distinct ids, so a batch repeats some (summed embedding rows)
        return rng.integers(0, 20, size=(samples, int(kind[len("tokens"):]))).astype("int32")
    return x.astype("float32")


def initial_weights(model, rng):
    """The same starting point in every process and on every backend (not the backend's RNG)."""
    return [(1.0 if "gamma" in w.path else 0.0) + rng.normal(size=w.shape) * 0.3
            for w in model.weights]


# -- one case ---------------------------------------------------------------------------------
def train(name, spec, mode, out_path):
    """mode: "distributed" (this rank's part, DistributedOptimizer), "sharded" (the same with
    shard_optimizer_state=True), "reference" (the global batch, plain optimizer) or
    "accumulated" (plain optimizer accumulating over size() passes, each pass one rank's part,
    in rank order)."""
    rank, size = mgpu.rank(), mgpu.size()
    passes = spec.get("passes", 1)
    keras.mixed_precision.set_global_policy(spec.get("policy", "float32"))
    try:
        rng = np.random.default_rng(case_seed(name))
        per_pass = GLOBAL_BATCH // passes  # samples per backward pass, all ranks together
        sample_weight = None
        if spec["inputs"].startswith("hub:"):
            x, y, sample_weight = exactness_hub.data(spec["inputs"][4:], STEPS * GLOBAL_BATCH, rng)
        else:
            x = inputs(spec["inputs"], STEPS * GLOBAL_BATCH, rng)
            x = x.astype(spec["ids"]) if "ids" in spec else x
            y = rng.integers(0, 3, size=len(x))
        model = spec["model"](**({"synchronized": mode in ("distributed", "sharded")}
                                 if spec.get("synchronized") else {}))
        model.set_weights(initial_weights(model, rng))
        # The DistributedOptimizer accumulates itself; the references use Keras's own.
        steps = {"distributed": 1, "sharded": 1, "reference": passes,
                 "accumulated": passes * size}[mode]
        optimizer = spec["optimizer"](**(
            {"gradient_accumulation_steps": steps} if steps > 1 else {}))
        if spec.get("loss_scale"):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        batch = per_pass if mode == "reference" else per_pass // size
        distributed = mode in ("distributed", "sharded")
        way = spec.get("feed", "split") if distributed else "split"
        if distributed:
            optimizer = mgpu.DistributedOptimizer(optimizer, backward_passes_per_step=passes,
                                                  shard_optimizer_state=mode == "sharded")
            if way != "shard":  # mgpu.data.shard takes every sample and splits them itself
                # Rank r's part of each pass's global batch: the samples 1 process x per_pass
                # sees.
                take = np.concatenate([np.arange(start + rank * batch, start + (rank + 1) * batch)
                                       for start in range(0, len(y), per_pass)])
                x, y, sample_weight = keras.tree.map_structure(
                    lambda a: None if a is None else a[take], (x, y, sample_weight),
                    none_is_leaf=True)
        model.compile(optimizer=optimizer, auto_scale_loss=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(**feeding(way, x, y, sample_weight, batch, spec), epochs=1, shuffle=False,
                  verbose=0)
        if spec.get("loss_scale"):  # the steps the loss scaler skipped show in its scale
            print(f"{name} {mode}: loss scale {float(optimizer_scale(optimizer)):g}", flush=True)
        np.savez(out_path, *model.get_weights(),
                 iterations=keras.ops.convert_to_numpy(optimizer.iterations),
                 learning_rate=keras.ops.convert_to_numpy(optimizer.learning_rate),
                 state_bytes=sharding.state_bytes(optimizer))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def optimizer_scale(optimizer):
    while not hasattr(optimizer, "dynamic_scale"):
        optimizer = optimizer.inner_optimizer
    return keras.ops.convert_to_numpy(optimizer.dynamic_scale)


def feeding(way, x, y, sample_weight, batch, spec):
    """fit's data arguments for feeding `way` (keras-hub cases: exactness_hub.feed)."""
    if spec["inputs"].startswith("hub:"):
        return exactness_hub.feed(way, x, y, sample_weight, batch)
    if way == "shard":
        return {"x": mgpu.data.shard((x, y), batch_size=batch)}
    return {"x": x, "y": y, "batch_size": batch}


def raw_tf_variable(distributed, out_path):
    """A tf.Variable given to apply_gradients (issue 25 item 4), rank r's gradient (r+1) g."""
    import tensorflow as tf

    variable = tf.Variable(np.linspace(-1.0, 1.0, 6, dtype="float32").reshape(2, 3))
    gradient = np.arange(6, dtype="float32").reshape(2, 3)
    if distributed:
        optimizer = mgpu.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        gradient = gradient * (mgpu.rank() + 1)
    else:
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        gradient = gradient * (mgpu.size() + 1) / 2  # the average over the ranks
    for _ in range(STEPS):
        optimizer.apply_gradients([(tf.constant(gradient), variable)])
    np.savez(out_path, variable.numpy(), iterations=optimizer.iterations.numpy(),
             learning_rate=keras.ops.convert_to_numpy(optimizer.learning_rate),
             state_bytes=sharding.state_bytes(optimizer))


def main():
    names, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    rank, size = mgpu.rank(), mgpu.size()
    for index, name in enumerate(names):
        spec = CASES.get(name, {})
        modes = ["distributed"]
        if os.environ.get("EXACTNESS_SHARD") == "1" and name != "raw_tf_variable":
            modes.append("sharded")  # one tf.Variable: fewer variables than ranks
        if index % size == rank:  # this rank's share of the single-process references
            modes += ["reference"] + (["accumulated"] if spec.get("ranks_as_passes") else [])
        for mode in modes:
            suffix = {"distributed": f"rank{rank}", "sharded": f"sharded.rank{rank}"}.get(mode,
                                                                                     mode)
            out = os.path.join(out_dir, f"{name}.{suffix}")
            if name == "raw_tf_variable":
                raw_tf_variable(mode == "distributed", out)
            else:
                train(name, spec, mode, out)
        print(f"rank {rank}: {name} done", flush=True)
    mgpu.barrier()


if __name__ == "__main__":
    main()
