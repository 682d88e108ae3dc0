"""Does TensorFlow on the GPU machine train a keras-hub GPT-2 as it does on the CPU?

Issue 63's first "must hold": on the GPU machine TF trained keras-hub GPT-2 small far slower per
epoch than JAX or torch, while on the CPU a tiny GPT-2 learns alike on all three. This script
compares, from the SAME initial weights and the SAME batches, one backend on one device with a
reference written by another run:

    python transformer_check.py --save ref.npz                  # the reference run (CPU)
    python transformer_check.py --compare ref.npz               # this run against it

What it compares, in float32 with TF32 off (the caller sets NVIDIA_TF32_OVERRIDE=0 and, for
JAX, JAX_DEFAULT_MATMUL_PRECISION=highest; TF's own switch is set below):
  1. the forward pass of every layer at the initial weights (the first layer that differs by
     more than rounding names the suspect kernel);
  2. the gradient of every variable at the initial weights;
  3. the loss of each of --steps AdamW steps on fixed learnable batches, and the weights after.

The initial weights and batches are made by the reference run and stored in its npz, so the
runs differ only in backend and device. Prints one JSON line per section; exits 0.
"""

import argparse
import json
import os

import numpy as np

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--save", help="write the reference (weights, batches, results) here")
parser.add_argument("--compare", help="compare with the reference in this npz")
parser.add_argument("--size", default="small", choices=["tiny", "small"])
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--precision", default="float32", choices=["float32", "mixed_bfloat16"])
args = parser.parse_args()

import keras  # noqa: E402
import keras_hub  # noqa: E402

if keras.backend.backend() == "tensorflow":
    import tensorflow as tf
    tf.config.experimental.enable_tensor_float_32_execution(False)
keras.mixed_precision.set_global_policy(args.precision)
LAYERS, HEADS, HIDDEN, FF, VOCAB = {"tiny": (2, 2, 64, 256, 512),
                                    "small": (6, 8, 512, 2048, 8192)}[args.size]
SEQ, BATCH = (64, 8) if args.size == "tiny" else (256, 32)

keras.utils.set_random_seed(0)
backbone = keras_hub.models.GPT2Backbone(
    vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, hidden_dim=HIDDEN,
    intermediate_dim=FF, max_sequence_length=SEQ, dropout=0.0)
model = keras.Model(backbone.input, backbone.token_embedding(backbone.output, reverse=True))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss=loss_fn)

reference = dict(np.load(args.compare)) if args.compare else None
if reference is None:
    rng = np.random.default_rng(0)
    start = rng.integers(1, VOCAB, size=(BATCH * args.steps, 1))
    stride = rng.integers(1, 4, size=(BATCH * args.steps, 1))
    tokens = 1 + (start + stride * np.arange(SEQ + 1)[None, :]) % (VOCAB - 1)
    initial = [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.weights]
else:
    tokens = reference["tokens"]
    initial = [reference[f"w{i}"] for i in range(len(model.weights))]
    model.set_weights(initial)


def inputs_of(rows):
    ids = tokens[rows, :-1]
    return {"token_ids": ids, "padding_mask": np.ones_like(ids, dtype=bool)}


first = slice(0, BATCH)
# 1. every layer's output at the initial weights
probe_layers = [layer for layer in backbone.layers if not isinstance(layer, keras.layers.InputLayer)]
probe = keras.Model(backbone.input, [layer.output for layer in probe_layers])
forward = [np.asarray(keras.ops.convert_to_numpy(out), dtype=np.float32)
           for out in probe(inputs_of(first))]
# 2. gradients at the initial weights (the backend's own autodiff)
x, y = inputs_of(first), tokens[first, 1:]
trainable = model.trainable_variables
if keras.backend.backend() == "tensorflow":
    with tf.GradientTape() as tape:
        loss0 = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss0, trainable)
elif keras.backend.backend() == "jax":
    import jax
    values = [v.value for v in trainable]
    others = [v.value for v in model.non_trainable_variables]

    def compute(tv):
        out, _ = model.stateless_call(tv, others, x, training=True)
        return loss_fn(y, out)
    loss0, grads = jax.value_and_grad(compute)(values)
else:
    model.zero_grad() if hasattr(model, "zero_grad") else None
    loss0 = loss_fn(y, model(x, training=True))
    loss0.backward()
    grads = [v.value.grad for v in trainable]
grads = [np.asarray(keras.ops.convert_to_numpy(g), dtype=np.float32) for g in grads]
# 3. training steps
losses = []
for step in range(args.steps):
    rows = slice(step * BATCH, (step + 1) * BATCH)
    losses.append(float(model.train_on_batch(inputs_of(rows), tokens[rows, 1:])))
final = [np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float32) for v in model.weights]

where = {"backend": keras.backend.backend(), "precision": args.precision,
         "device": os.environ.get("CUDA_VISIBLE_DEVICES", "(all)"), "size": args.size}
if reference is None:
    np.savez(args.save, tokens=tokens, losses=np.array(losses),
             **{f"w{i}": w for i, w in enumerate(initial)},
             **{f"f{i}": f for i, f in enumerate(forward)},
             **{f"g{i}": g for i, g in enumerate(grads)},
             **{f"final{i}": w for i, w in enumerate(final)})
    print(json.dumps({**where, "saved": args.save, "losses": [round(v, 4) for v in losses]}))
else:
    def rel(a, b, floor=1e-30):
        return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor))

    def global_rel(mine, theirs):  # ||a - b|| / ||b|| over every tensor together
        num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(mine, theirs))
        return (num / max(sum(float(np.sum(b ** 2)) for b in theirs), 1e-30)) ** 0.5

    layer_diffs = [(layer.name, rel(f, reference[f"f{i}"]))
                   for i, (layer, f) in enumerate(zip(probe_layers, forward))]
    worst_layer = max(layer_diffs, key=lambda item: item[1])
    first_bad = next((item for item in layer_diffs if item[1] > 1e-3), None)
    ref_grads = [reference[f"g{i}"] for i in range(len(grads))]
    # a gradient that is zero in exact arithmetic (attention's key bias) is rounding noise on
    # every device: measure each against a floor of 1e-6 of the largest gradient
    floor = 1e-6 * max(float(np.max(np.abs(g))) for g in ref_grads)
    grad_diffs = [(v.path, rel(g, r, floor)) for v, g, r in zip(trainable, grads, ref_grads)]
    worst_grad = max(grad_diffs, key=lambda item: item[1])
    ref_final = [reference[f"final{i}"] for i in range(len(final))]
    print(json.dumps({**where, "forward_worst": worst_layer, "forward_first_over_1e-3": first_bad,
                      "grad_worst": worst_grad, "grads_global_rel": global_rel(grads, ref_grads),
                      "weights_after_steps_global_rel": global_rel(final, ref_final),
                      "losses": [round(v, 4) for v in losses],
                      "reference_losses": [round(float(v), 4) for v in reference["losses"]]}))
