"""Where a Keras-TF ResNet-50 step goes on one GPU (issue 24): one process, one precision.

Each variant trains the same compiled model for --steps steps after its own warm-up and
reports img/s from the wall time of the timed part, which ends by reading the loss (a wait
for the device):

  fit-pydataset-device  model.fit on a PyDataset returning one device-resident batch
                        (mgpu-bench's --data device for TensorFlow)
  fit-tfdata            model.fit on tf.data.Dataset.from_tensors(host batch).repeat()
  fit-tfdata-gpu        the same, the batch copied to the GPU inside tf.data
                        (tf.data.experimental.copy_to_device + prefetch)
  fit-tfdata-spe8       fit-tfdata with steps_per_execution=8 (8 steps per tf.function call)
  fit-tfdata-gpu-spe8   fit-tfdata-gpu with steps_per_execution=8
  fit-tfdata-gpu-plain  fit-tfdata-gpu with the plain SGD, no DistributedOptimizer: its cost
  train-function        Keras's own compiled train function called in a Python loop on a
                        Python iterator of the device-resident batch: no fit loop, no
                        tf.data, and none of the per-call wait Keras's tf.data path has
                        (its OptionalHasValue read)
  step-xla              a hand-written tf.function(jit_compile=True) step (tape, loss, the
                        same optimizer) on device-resident tensors: TF's device floor
  step-graph            the same without XLA

    python benchmarks/tf_gpu/probe.py --precision float32 --out OUT.json
"""

import argparse
import json
import time

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--precision", default="float32")
parser.add_argument("--batch", type=int, default=128)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--variants", default="fit-pydataset-device,fit-tfdata,fit-tfdata-gpu,"
                    "fit-tfdata-spe8,fit-tfdata-gpu-spe8,fit-tfdata-gpu-plain,train-function,"
                    "step-xla")
parser.add_argument("--out", required=True)
args = parser.parse_args()

keras.mixed_precision.set_global_policy(args.precision)
rng = np.random.default_rng(0)
x_host = rng.random((args.batch, 224, 224, 3), dtype=np.float32)
y_host = rng.integers(0, 1000, (args.batch,)).astype("int32")
with tf.device("/GPU:0"):
    x_dev, y_dev = tf.identity(x_host), tf.identity(y_host)


def build(steps_per_execution=1, plain=False):
    model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    optimizer = keras.optimizers.SGD(0.0125, momentum=0.9)
    model.compile(optimizer=optimizer if plain else mgpu.DistributedOptimizer(optimizer),
                  loss="sparse_categorical_crossentropy",
                  steps_per_execution=steps_per_execution)
    return model


class Device(keras.utils.PyDataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        return x_dev, y_dev


def tfdata(on_gpu=False):
    data = tf.data.Dataset.from_tensors((x_host, y_host)).repeat()
    if on_gpu:
        data = data.apply(tf.data.experimental.copy_to_device("/GPU:0")).prefetch(2)
    return data.prefetch(2) if not on_gpu else data


def time_fit(model, data, steps):
    model.fit(data, steps_per_epoch=args.warmup, epochs=1, verbose=0)
    start = time.perf_counter()
    history = model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    float(history.history["loss"][-1])
    return time.perf_counter() - start


def time_train_function(model, steps):
    model.make_train_function()
    batches = iter(lambda: (x_dev, y_dev), None)  # endless, device-resident
    for _ in range(args.warmup):
        logs = model.train_function(batches)
    float(logs["loss"])
    start = time.perf_counter()
    for _ in range(steps):
        logs = model.train_function(batches)
    float(logs["loss"])
    return time.perf_counter() - start


def time_step(jit):
    model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    optimizer = keras.optimizers.SGD(0.0125, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy()
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=jit)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for _ in range(args.warmup):
        loss = step(x_dev, y_dev)
    float(loss)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(x_dev, y_dev)
    float(loss)
    return time.perf_counter() - start


gpus = tf.config.list_physical_devices("GPU")
results = {"precision": args.precision, "batch": args.batch, "steps": args.steps,
           "device": tf.config.experimental.get_device_details(gpus[0]).get("device_name")
           if gpus else "CPU",
           "tensorflow": tf.__version__, "keras": keras.__version__, "variants": {}}
shared = None
for variant in args.variants.split(","):
    try:
        if variant == "fit-pydataset-device":
            shared = shared or build()
            seconds = time_fit(shared, Device(), args.steps)
        elif variant in ("fit-tfdata", "fit-tfdata-gpu"):
            shared = shared or build()
            seconds = time_fit(shared, tfdata(variant.endswith("gpu")), args.steps)
        elif variant in ("fit-tfdata-spe8", "fit-tfdata-gpu-spe8"):
            seconds = time_fit(build(steps_per_execution=8), tfdata("gpu" in variant),
                               args.steps)
        elif variant == "fit-tfdata-gpu-plain":
            seconds = time_fit(build(plain=True), tfdata(True), args.steps)
        elif variant == "train-function":
            shared = shared or build()
            seconds = time_train_function(shared, args.steps)
        elif variant in ("step-xla", "step-graph"):
            seconds = time_step(variant == "step-xla")
        else:
            raise ValueError(f"unknown variant {variant!r}")
        row = {"img_per_sec": round(args.steps * args.batch / seconds, 1),
               "step_ms": round(1000 * seconds / args.steps, 2)}
    except Exception as error:  # noqa: BLE001 -- a variant that fails is a finding, not the end
        row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    results["variants"][variant] = row
    print(f"[probe {args.precision}] {variant}: {row}", flush=True)
with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
