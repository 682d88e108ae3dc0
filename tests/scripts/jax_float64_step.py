"""Test worker: the JAX engine's 2-process step against Keras's own step, in float64.

    JAX_ENABLE_X64=1 XLA_FLAGS=--xla_disable_hlo_passes=cse \
        mgpu-train -np 2 jax_float64_step.py

Every rank trains on the SAME 8 rows, so the average of the ranks' gradients is exactly each
rank's gradient (x + x and a halving are exact in binary floating point): the distributed step
must then produce exactly what one process with those rows does. For SGD and then Adam, 4
steps each, rank 0 trains the same model with the plain optimizer in-process afterwards and
prints ``max_rel`` (the largest difference over all weights, relative to the weight's largest
magnitude) and whether the ranks agree.

The model is an embedding, Keras's MultiHeadAttention and a LayerNormalization: even in float64
both compute in float32 on JAX (the attention's softmax in ``jax.nn.dot_product_attention``,
the normalization's statistics through Keras's ``result_type``), which is where XLA's
multi-device program rounds differently from the one-device program unless its early CSE is
off (docs/backends.md, "Rounding: the step is another XLA program").
"""

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402  (after mgpu.init: the dtype policy is set below)

keras.config.set_floatx("float64")
keras.config.set_dtype_policy("float64")


def train(distributed: bool, name: str):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, size=(8, 8)).astype("int32")
    labels = rng.integers(0, 3, 8)
    inputs = keras.Input((8,), dtype="int32")
    embedded = keras.layers.Embedding(40, 16)(inputs)
    attended = keras.layers.MultiHeadAttention(2, 8)(embedded, embedded)
    normal = keras.layers.LayerNormalization()(embedded + attended)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(normal))
    model = keras.Model(inputs, outputs)
    model.set_weights([rng.normal(size=w.shape) * 0.3 + (1.0 if "gamma" in w.path else 0.0)
                       for w in model.weights])
    optimizer = keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)
    if distributed:
        optimizer = mgpu.DistributedOptimizer(optimizer)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(4):
        model.train_on_batch(tokens, labels)
    return [np.asarray(w) for w in model.get_weights()]


for name in ("sgd", "adam"):  # SGD shows a wrong scale, Adam wrong state (it hides a scale)
    ours = train(True, name)
    everyone = mgpu.allgather_object(ours)
    agree = all(np.array_equal(a, b) for theirs in everyone for a, b in zip(everyone[0], theirs))
    if mgpu.rank() == 0:
        alone = train(False, name)
        rel = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(ours, alone))
        print(f"{name} dtype {ours[0].dtype} ranks agree: {agree} max_rel {rel:.3g}", flush=True)
    mgpu.barrier()
