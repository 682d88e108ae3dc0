"""Test worker: synchronized BatchNorm, N ranks x batch b against 1 process x batch N*b.

    mgpu-train -np 2 sync_bn.py OUT_DIR

Each rank trains, in one job: a small CNN whose two BatchNormalization layers are
``mgpu.layers.SyncBatchNormalization`` and ``keras.layers.BatchNormalization(synchronized=True)``
("sync"), the same with plain local BatchNormalization ("local", which must NOT match), the
same statistics under a Keras mask ("masked": Masking -> Dense -> BatchNormalization), and
(TensorFlow, torch) an uneven case: rank r has 3 + 2r samples, summed loss and op=Sum, so the
job's gradient is that of the 3 + 5 samples together. The references are trained in the same
process with plain Keras (plain optimizer, plain BatchNormalization, no collective) on the
global batches, from the same initial weights. Writes OUT_DIR/rank.R.npz with, per case,
the distributed weights (``<case>.<i>``) and the reference's (``<case>_ref.<i>``); rank 1 also
predicts alone with the trained sync model (``predict.0``), which only works if inference runs
no collective.
"""

import os
import sys

import numpy as np

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402 - after init, as the README asks

import exact_math  # noqa: E402 - tests/scripts/exact_math.py: TF32 off on GPU sessions

exact_math.apply_if_asked(keras.backend.backend())

out_dir = sys.argv[1]
rank, size = mgpu.rank(), mgpu.size()
BACKEND = keras.backend.backend()
rng = np.random.default_rng(0)
# A mean far from zero against the spread: the statistics must not cancel (E[x^2] - E[x]^2).
x = (rng.normal(size=(24, 5, 5, 3)) * 2.0 + 3.0).astype("float32")
y = rng.integers(0, 3, size=24)
results = {}


def build(synchronized: bool):
    keras.utils.set_random_seed(3)
    second = (keras.layers.BatchNormalization(synchronized=True, momentum=0.5) if synchronized
              else keras.layers.BatchNormalization(momentum=0.5))
    first = (mgpu.layers.SyncBatchNormalization(momentum=0.5) if synchronized
             else keras.layers.BatchNormalization(momentum=0.5))
    return keras.Sequential([
        keras.Input((5, 5, 3)), keras.layers.Conv2D(4, 3), first, keras.layers.ReLU(),
        keras.layers.Flatten(), keras.layers.Dense(6), second, keras.layers.Dense(3)])


def compile_(model, distributed: bool, reduction="sum_over_batch_size"):
    inner = keras.optimizers.SGD(0.1, momentum=0.9)
    op = mgpu.Sum if reduction == "sum" else mgpu.Average
    model.compile(optimizer=mgpu.DistributedOptimizer(inner, op=op) if distributed else inner,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  reduction=reduction))
    return model


def local_part(global_batch):
    chunk = global_batch // size
    return np.concatenate([np.arange(start + rank * chunk, start + (rank + 1) * chunk)
                           for start in range(0, len(x), global_batch)])


def keep(case, model, reference):
    for prefix, weights in ((case, model.get_weights()), (case + "_ref", reference.get_weights())):
        results.update({f"{prefix}.{i}": w for i, w in enumerate(weights)})


# -- even batches: 3 steps of 2 x 4 through fit ------------------------------------------------
take = local_part(8)
reference = compile_(build(False), distributed=False)
reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
for case, synchronized in (("sync", True), ("local", False)):
    model = compile_(build(synchronized), distributed=True)
    model.fit(x[take], y[take], batch_size=8 // size, epochs=1, shuffle=False, verbose=0)
    keep(case, model, reference)
    if case == "sync" and rank == size - 1:
        results["predict.0"] = model.predict(x[:6], verbose=0)  # alone: no collective
        results["predict_ref.0"] = reference.predict(x[:6], verbose=0)

# -- uneven batches: rank r has 3 + 2r of every 8 samples, 2 steps (not JAX: its step ---------
# -- needs the same batch shape on every rank) --------------------------------------------------
if BACKEND != "jax" and size == 2:
    mine = slice(0, 3) if rank == 0 else slice(3, 8)
    model = compile_(build(True), distributed=True, reduction="sum")
    reference = compile_(build(False), distributed=False, reduction="sum")
    for start in (0, 8):
        batch = slice(start + mine.start, start + mine.stop)
        model.train_on_batch(x[batch], y[batch])
        reference.train_on_batch(x[start:start + 8], y[start:start + 8])
    keep("uneven", model, reference)

# -- a mask (Masking -> Dense -> BatchNorm over time steps): only unmasked steps count ----------
steps = x[:16, :4, 0, :].copy()
steps[rng.random((16, 4)) < 0.3] = 0.0


def masked_model(synchronized: bool):
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((4, 3)), keras.layers.Masking(0.0), keras.layers.Dense(5),
        keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])


take = local_part(8)[:16 // size]
model = compile_(masked_model(True), distributed=True)
model.fit(steps[take], y[take], batch_size=8 // size, epochs=1, shuffle=False, verbose=0)
reference = compile_(masked_model(False), distributed=False)
reference.fit(steps, y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
keep("masked", model, reference)

np.savez(os.path.join(out_dir, f"rank.{rank}.npz"), **results)
print("sync_bn done", rank, sorted({key.split(".")[0] for key in results}))
