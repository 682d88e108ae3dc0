"""mgpu-bench's ``mirrored`` reference row: Keras 3 + ``tf.distribute.MirroredStrategy``.

    KERAS_BACKEND=tensorflow python -m mgpu_launch.bench.mirrored --gpus 2 --result r.json \\
        --model resnet50 --precision mixed_bfloat16 --data device,host

What a TensorFlow user has without mgpu-launch: ONE process that replicates the model over N
GPUs (the same GPUs the driver gave the N-process job: it sets ``CUDA_VISIBLE_DEVICES`` to
them), the textbook recipe: build and compile under ``strategy.scope()`` with Keras's default
``jit_compile`` and the model's optimizer at N times its rate (``models.py``: SGD(0.0125 x N,
momentum=0.9); AdamW for the transformers), global batch = N x ``--batch-per-gpu``.
No mgpu code runs in the step (no ``mgpu.init()``, no ``DistributedOptimizer``): the gradients
are summed by the strategy's own cross-device ops (NCCL on GPUs). With no GPU, ``--gpus 1``
mirrors over the CPU device (the CPU test runs it end to end); more replicas need GPUs.

Same model, precision, data format, data modes and timing as the Keras worker (``worker.py``:
the loss read back every ``--window`` steps after the warm-up, the median window), so the row
sits beside the tensorflow row. Input per ``--data`` mode (``fit`` under a strategy takes only
what the strategy can split, so ``device`` is the closest it allows):

- ``device``: the one global batch as ``tf.data.Dataset.from_tensors(...).repeat()``; the
  strategy's distributed iterator splits it and prefetches each replica's part onto its GPU
  (a host-to-device copy per step, overlapped with the step; not resident as in the mgpu rows);
- ``host`` / ``host-uint8``: the worker's PyDataset of numpy batches (global size);
- ``numpy``: ``fit(x, y, batch_size=N x batch)`` on in-memory arrays, shuffled.

``--prefetch`` (mgpu's device prefetch), ``--cuda-graph`` and ``--compression`` do not apply:
one row per data mode, ``prefetch`` None. ``--profile`` gives the one process's input and step
time (``wait_ms`` 0: no other rank to wait for).
"""

import json
import sys
import time

from mgpu_launch.bench import profile
from mgpu_launch.bench.clock import StepTimer, make_window_timer, median_rate, waits
from mgpu_launch.bench.models import MODELS
from mgpu_launch.bench.worker import (device_name, get_parser, synthetic_batches,
                                      throughput_fields, versions)
from mgpu_launch.runtime import folders


def parse_args(argv=None):
    """The worker's options plus ``--gpus``: the number of replicas of the one process."""
    parser = get_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=1,
                        help="replicas: the first N visible GPUs (1 without a GPU: the CPU)")
    args = parser.parse_args(argv)
    if args.gpus < 1:
        parser.error(f"--gpus {args.gpus}: expected a replica count >= 1")
    return args


def progress(message: str) -> None:
    print(f"[mgpu-bench] {message}", flush=True)


def replica_devices(tf, count: int) -> list:
    """The devices MirroredStrategy mirrors over: the first `count` GPUs, or the CPU for 1.

    Raises:
        SystemExit: (status 2) when this machine shows fewer GPUs than `count`.
    """
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus and count == 1:
        return ["/cpu:0"]
    if len(gpus) < count:
        print(f"mgpu-bench mirrored: --gpus {count} needs {count} GPUs for MirroredStrategy, "
              f"but TensorFlow sees {len(gpus)} (CUDA_VISIBLE_DEVICES, the driver, or a CPU-only "
              f"TensorFlow). On CPU the mirrored row runs only at --gpus 1, over the CPU device; "
              f"ask for at most {max(len(gpus), 1)}.", file=sys.stderr)
        raise SystemExit(2)
    try:  # else TF takes memory on every visible GPU (the driver already narrows them)
        tf.config.set_visible_devices(gpus[:count], "GPU")
    except RuntimeError:  # the devices are initialized already: the mirror still uses [:count]
        pass
    return [f"/gpu:{index}" for index in range(count)]


def main(argv=None) -> None:
    args = parse_args(argv)
    import keras
    import numpy as np
    import tensorflow as tf

    if keras.backend.backend() != "tensorflow":
        print(f"mgpu-bench mirrored: KERAS_BACKEND={keras.backend.backend()}, but "
              f"MirroredStrategy needs the tensorflow backend; set KERAS_BACKEND=tensorflow "
              f"(mgpu-bench does for --backend mirrored).", file=sys.stderr)
        raise SystemExit(2)
    devices = replica_devices(tf, args.gpus)
    strategy = tf.distribute.MirroredStrategy(devices)
    spec = MODELS[args.model]
    batch = args.batch_per_gpu or spec.batch_per_gpu
    global_batch = batch * strategy.num_replicas_in_sync
    keras.mixed_precision.set_global_policy(args.precision)
    keras.config.set_image_data_format(args.data_format)  # before any layer is built
    shape = spec.shape(args.data_format)
    started = time.monotonic()
    with strategy.scope():
        model = spec.build(keras, shape)
        model.compile(**spec.compile_arguments(keras, learning_rate_scale=args.gpus))
    synthetic = synthetic_batches(np, spec, shape, global_batch, seed=0)
    total = args.warmup_steps + args.steps
    progress(f"mirrored {args.model} over {', '.join(devices)} built "
             f"({model.count_params() / 1e6:.2f}M parameters) in "
             f"{time.monotonic() - started:.0f} s; {total} steps per input mode, batch {batch} "
             f"per replica ({global_batch} global)")

    class Batches(keras.utils.PyDataset):
        def __init__(self, mode: str):
            super().__init__()
            self.batches = synthetic[mode]

        def __len__(self):
            return total

        def __getitem__(self, index):
            return self.batches[index % len(self.batches)]

    def fit(mode: str, callback) -> None:
        if mode == "numpy":
            x, y = keras.tree.map_structure(lambda *parts: np.concatenate(parts), *[
                synthetic["host"][i % 4] for i in range(total)])
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=True, verbose=0,
                      callbacks=[callback])
        elif mode == "device":
            data = tf.data.Dataset.from_tensors(synthetic["host"][0]).repeat(total)
            model.fit(data, epochs=1, verbose=0, callbacks=[callback])
        else:
            model.fit(Batches(mode), epochs=1, verbose=0, callbacks=[callback])

    step_timer = StepTimer("tensorflow")
    model.make_train_function(force=True)
    model.train_function = step_timer.wrap(model.train_function)
    rows = []
    for mode in args.data.split(","):
        progress(f"data {mode}: fit")
        timer = make_window_timer(keras, args, total, report=progress)
        step_timer.reset()
        fit(mode, timer)
        rate = median_rate(timer.stamps, args.window, global_batch)
        host_ms, _ = step_timer.medians()
        rows.append({"model": args.model, "data": mode, "prefetch": None,
                     "data_format": keras.config.image_data_format(),
                     "batch_per_gpu": batch, "params": model.count_params(),
                     "img_per_sec": round(rate, 1), "per_rank_img_per_sec": [round(rate, 1)],
                     **throughput_fields(spec, rate),
                     # Keras's TF step, built at its first call: ready after it
                     **waits(timer.first_step, timer.warmup, timer.ready_step, lambda v: [v]),
                     "step_path": "compiled" if model.jit_compile else "graph",
                     "step_fallback": None,
                     "processes": 1, "replicas": strategy.num_replicas_in_sync,
                     "devices": devices, "strategy": type(strategy).__name__,
                     "jit_compile": bool(model.jit_compile),
                     "step_ms": round(1000 * global_batch / rate, 2),
                     "train_function_host_ms": host_ms, "train_function_device_ms": None})
        progress(f"data {mode}: {rate:.0f} samples/s; in the train function {host_ms} ms host")
        if args.profile:
            clock = profile.make_callback(keras, args.warmup_steps)
            fit(mode, clock)
            rows[-1]["per_rank_profile"] = profile.breakdown(clock.steps, gather=lambda s: [s])
            progress(f"data {mode}: profile " + ", ".join(
                f"{k} {v}" for k, v in rows[-1]["per_rank_profile"][0].items()))
    folders.replace_file(args.result, json.dumps(
        {"rows": rows, "versions": versions(keras), "device": device_name(keras)}).encode())


if __name__ == "__main__":
    main()
