"""One rank of one mgpu-bench job (started by ``mgpu-bench`` through the launcher).

    mgpu-train -np 2 -m mgpu_launch.bench.worker --result r.json --model resnet50 \\
        --precision float32 --data host,device --prefetch 2

Builds the model once, compiles it with ``mgpu.DistributedOptimizer(SGD(momentum=0.9))`` and
runs ``model.fit`` once per input mode and prefetch depth on synthetic data; rank 0 writes the
per-rank rates to ``--result``. Lines with ``[mgpu-bench]`` are progress for the driver.
"""

import argparse
import json
import os
import platform
import statistics
import time

import mgpu_launch as mgpu
from mgpu_launch.bench.models import MODELS


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--result", required=True)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--batch-per-gpu", type=int)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--data", default="host")
    parser.add_argument("--prefetch", default="2")
    return parser.parse_args(argv)


def progress(message: str) -> None:
    if mgpu.is_chief():
        print(f"[mgpu-bench] {message}", flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    mgpu.init()  # before Keras touches a device (JAX)
    import keras
    import numpy as np

    spec = MODELS[args.model]
    batch = args.batch_per_gpu or spec.batch_per_gpu
    keras.mixed_precision.set_global_policy(args.precision)
    started = time.monotonic()
    model = spec.build(keras)
    model.compile(optimizer=mgpu.DistributedOptimizer(
        keras.optimizers.SGD(mgpu.scale_lr(0.0125), momentum=0.9)),
        loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(mgpu.rank())
    host = [(rng.random((batch,) + spec.input_shape, dtype=np.float32),
             rng.integers(0, spec.classes, (batch,)).astype("int32")) for _ in range(4)]
    total = args.warmup_steps + args.steps
    progress(f"{args.model} built ({model.count_params() / 1e6:.2f}M parameters) in "
             f"{time.monotonic() - started:.0f} s; {total} steps per input mode, batch "
             f"{batch} per process")

    class Batches(keras.utils.PyDataset):
        def __init__(self, on_device: bool):
            super().__init__()
            self.batches = ([tuple(keras.ops.convert_to_tensor(a) for a in host[0])]
                            if on_device else host)

        def __len__(self):
            return total

        def __getitem__(self, index):
            return self.batches[index % len(self.batches)]

    class WindowTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.stamps = []

        def on_train_batch_end(self, step, logs=None):
            done = step + 1 - args.warmup_steps  # windows start when the warm-up ends
            if done >= 0 and done % args.window == 0:
                float(logs["loss"])  # waits for the device
                self.stamps.append(time.perf_counter())
                if done == 0 or step + 1 == total:
                    progress(f"  step {step + 1}/{total}")

    def fit(mode: str) -> dict:
        timer = WindowTimer()
        if mode == "numpy":
            x = np.empty((total * batch,) + spec.input_shape, np.float32)
            y = np.empty((total * batch,), np.int32)
            for index in range(total):
                x[index * batch:(index + 1) * batch], y[index * batch:(index + 1) * batch] = \
                    host[index % len(host)]
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=True, verbose=0,
                      callbacks=[timer])
        else:
            model.fit(Batches(mode == "device"), epochs=1, verbose=0, callbacks=[timer])
        return statistics.median(args.window * batch / (t1 - t0)
                                 for t0, t1 in zip(timer.stamps, timer.stamps[1:]))

    rows = []
    for mode in args.data.split(","):
        depths = [int(d) for d in args.prefetch.split(",")]
        for depth in depths[:1] if mode == "device" else depths:
            os.environ["MGPU_PREFETCH"] = str(depth)
            progress(f"data {mode}, prefetch {depth}: fit")
            per_rank = mgpu.allgather_object(fit(mode))
            rows.append({"model": args.model, "data": mode, "prefetch": depth,
                         "batch_per_gpu": batch, "params": model.count_params(),
                         "img_per_sec": round(sum(per_rank), 1),
                         "per_rank_img_per_sec": [round(r, 1) for r in per_rank]})
            progress(f"data {mode}, prefetch {depth}: {sum(per_rank):.0f} img/s")
    if mgpu.is_chief():
        with open(args.result, "w") as f:
            json.dump({"rows": rows, "versions": versions(keras), "device": device_name(keras)},
                      f)


def versions(keras) -> dict:
    import numpy
    found = {"python": platform.python_version(), "keras": keras.__version__,
             "numpy": numpy.__version__, "mgpu_launch": _own_version()}
    backend = keras.backend.backend()
    found[backend] = __import__(backend).__version__
    return found


def _own_version() -> str:
    import mgpu_launcher as launcher
    return launcher.__version__


def device_name(keras) -> str:
    backend = keras.backend.backend()
    if backend == "jax":
        import jax
        return jax.local_devices()[0].device_kind
    if backend == "torch":
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    return tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU") \
        if gpus else "cpu"


if __name__ == "__main__":
    main()
