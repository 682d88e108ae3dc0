"""Why the JAX engine's 2-process step is not bit-identical to Keras's 1-process step (issue 48).

No mgpu_launch here: one process, two virtual CPU devices. The same function is compiled twice,
``jax.jit(f)`` and ``jax.jit(jax.shard_map(f, mesh of 2 devices))`` with each device given the
same rows and no collective at all, and the results are compared bit for bit.

    python benchmarks/jax_spmd_rounding.py                                   # they differ
    XLA_FLAGS=--xla_disable_hlo_passes=cse python benchmarks/jax_spmd_rounding.py   # identical

Part 1, pure JAX: the float32 gradient of ``jax.nn.dot_product_attention``.
Part 2, Keras in float64 (x64 on): Embedding + MultiHeadAttention + LayerNormalization, 4 steps
of Keras's own ``train_step`` under SGD and Adam; on JAX both layers compute in float32
whatever the dtype policy. The figures match ``mgpu-train -np 2`` with the same rows on both
ranks (tests/scripts/jax_float64_step.py), so the engine adds nothing to them.
It also counts, in each compiled program, the float32 divisions of the attention's shape: the
2-device program keeps one that the 1-device program turned into a multiplication by a
reciprocal. Results and the explanation: benchmarks/jax_spmd_rounding.md.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["JAX_ENABLE_X64"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402


def both_programs(step, arguments, out_specs):
    """``step`` under jit, and under shard_map over 2 devices (each fed `arguments`)."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("d"), out_specs=out_specs,
                                   check_vma=False))
    doubled = jax.tree.map(lambda a: jnp.concatenate([a, a]), arguments)
    return jax.jit(step), mapped, doubled


def attention_gradient():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(8, 8, 2, 8)), "float32")  # batch, length, heads, depth
    w = jnp.asarray(rng.normal(size=q.shape), "float32")
    step = jax.grad(lambda a: jnp.sum(jax.nn.dot_product_attention(a, a, a) * w))
    plain, mapped, doubled = both_programs(step, q, P("d"))
    one, two = plain(q), mapped(doubled)[:8]
    divisions = [sum(" divide(" in line and "f32[1,8,2,8,8]" in line.split("=")[1][:20]
                     for line in program.lower(arg).compile().as_text().splitlines())
                 for program, arg in ((plain, q), (mapped, doubled))]
    print(f"attention gradient, float32: max abs difference "
          f"{float(jnp.max(jnp.abs(one - two))):.3g}, bit-identical "
          f"{bool(jnp.all(one == two))}; f32[1,8,2,8,8] divisions in the compiled programs: "
          f"1 device {divisions[0]}, 2 devices {divisions[1]}")


def keras_steps(optimizer_name):
    import keras
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    rng = np.random.default_rng(0)
    data = (jnp.asarray(rng.integers(0, 40, size=(8, 8)), "int32"),
            jnp.asarray(rng.integers(0, 3, 8)))
    inputs = keras.Input((8,), dtype="int32")
    embedded = keras.layers.Embedding(40, 16)(inputs)
    attended = keras.layers.MultiHeadAttention(2, 8)(embedded, embedded)
    normal = keras.layers.LayerNormalization()(embedded + attended)
    model = keras.Model(inputs, keras.layers.Dense(3)(
        keras.layers.GlobalAveragePooling1D()(normal)))
    model.set_weights([rng.normal(size=w.shape) * 0.3 + (1.0 if "gamma" in w.path else 0.0)
                       for w in model.weights])
    optimizer = (keras.optimizers.SGD(0.1) if optimizer_name == "sgd"
                 else keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    start = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in model.optimizer.variables],
             [v.value for v in model.metrics_variables])

    def state_step(state, batch):
        return model.train_step(state, batch)

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    mapped = jax.jit(jax.shard_map(state_step, mesh=mesh, in_specs=(P(), P("d")),
                                   out_specs=(P(), P()), check_vma=False))
    doubled = jax.tree.map(lambda a: jnp.concatenate([a, a]), data)
    results = []
    for program, batch in ((jax.jit(state_step), data), (mapped, doubled)):
        state = start
        for _ in range(4):
            _, state = program(state, batch)
        results.append([np.asarray(v) for v in state[0]])
    rel = max(float(np.max(np.abs(a - b)) / np.max(np.abs(a))) for a, b in zip(*results))
    print(f"keras {optimizer_name:4s} float64 ({results[0][0].dtype}), 4 steps: max relative "
          f"weight difference {rel:.3g}")


if __name__ == "__main__":
    import jaxlib
    import keras
    print(f"jax {jax.__version__} jaxlib {jaxlib.__version__} keras {keras.__version__}; "
          f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
    attention_gradient()
    keras_steps("sgd")
    keras_steps("adam")
