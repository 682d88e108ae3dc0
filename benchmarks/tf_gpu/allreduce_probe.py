"""How long the gradient allreduce takes alone, per backend, on the GPUs of one job (issue 38).

    KERAS_BACKEND=tensorflow mgpu-train -np 2 benchmarks/tf_gpu/allreduce_probe.py OUT.json \
        [serialization]
    KERAS_BACKEND=torch      mgpu-train -np 2 benchmarks/tf_gpu/allreduce_probe.py OUT.json

Each rank sums float32 buffers of 4, 25.6 and 102.2 MB (ResNet-50's gradients are 102.2 MB in
float32) across the job, 20 times after 3 warm-ups, and reads one element back at the end
(which waits for the device). TensorFlow: through the engine's own allreduce (the one the
DistributedOptimizer uses) inside ``tf.function(jit_compile=True)`` (XLA's all-reduce, what a
Keras step on GPUs runs) and ``jit_compile=False`` (TensorFlow's CollectiveReduceV2 kernel);
torch: ``torch.distributed.all_reduce`` (NCCL), the native reference. Reports ms per call and
the bus bandwidth (2 (N-1)/N x bytes / time, as nccl-tests counts it). Run with
``NCCL_DEBUG=INFO`` to see which transport NCCL picked (P2P/NVLink, SHM or network).
"""

import json
import sys
import time

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402

SIZES_MB = (4.0, 25.6, 102.2)
WARMUP, CALLS = 3, 20


def timed(call, read):
    for _ in range(WARMUP):
        out = call()
    read(out)
    start = time.perf_counter()
    for _ in range(CALLS):
        out = call()
    read(out)
    return (time.perf_counter() - start) / CALLS


def tensorflow_rows():
    import tensorflow as tf
    from mgpu_launch import backends
    engine = backends.get_engine()
    rows = []
    for megabytes in SIZES_MB:
        count = int(megabytes * 1e6 / 4)
        with tf.device("/GPU:0"):
            buffer = tf.random.normal([count], seed=mgpu.rank())
        for jit in (True, False)[0 if engine.compiles_collectives() else 1:]:
            function = tf.function(lambda t: engine.allreduce([t], average=True)[0],
                                   jit_compile=jit)
            seconds = timed(lambda: function(buffer), lambda out: float(out[0]))
            rows.append({"path": "tf xla" if jit else "tf graph", "mb": megabytes,
                         "ms": round(1e3 * seconds, 3)})
    return rows


def serialization_rows():
    """Is a call of a compiled program that holds a collective asynchronous? The same device
    work (16 matrix products, a few ms) with and without a 4 MB allreduce that depends on it:
    host seconds inside each call against wall seconds per call (20 calls, then one read)."""
    import tensorflow as tf
    from mgpu_launch import backends
    engine = backends.get_engine()
    with tf.device("/GPU:0"):
        a = tf.random.normal([4096, 4096], seed=1) * 0.01
        x = tf.random.normal([4096, 4096], seed=2)
        g = tf.random.normal([1_000_000], seed=mgpu.rank())

    def work(value):
        for _ in range(16):
            value = tf.matmul(value, a)
        return value

    plain = tf.function(lambda v, t: (work(v), t * 2.0), jit_compile=True)
    collective = tf.function(lambda v, t: (lambda y: (y, engine.allreduce(
        [t + tf.reduce_mean(y) * 0.0], average=True)[0]))(work(v)), jit_compile=True)
    rows = []
    for name, function in (("xla work", plain), ("xla work+allreduce", collective)):
        for _ in range(WARMUP):
            out = function(x, g)
        float(out[1][0])
        host, start = 0.0, time.perf_counter()
        for _ in range(CALLS):
            called = time.perf_counter()
            out = function(x, g)
            host += time.perf_counter() - called
        float(out[1][0])
        wall = time.perf_counter() - start
        rows.append({"path": name, "mb": 4.0, "ms": round(1e3 * wall / CALLS, 3),
                     "host_ms_in_call": round(1e3 * host / CALLS, 3)})
    return rows


def torch_rows():
    import torch
    import torch.distributed as dist
    rows = []
    for megabytes in SIZES_MB:
        buffer = torch.randn(int(megabytes * 1e6 / 4), device="cuda" if torch.cuda.is_available() else "cpu")
        seconds = timed(lambda: dist.all_reduce(buffer) or buffer,
                        lambda out: float(out[0]))
        rows.append({"path": "torch nccl", "mb": megabytes, "ms": round(1e3 * seconds, 3)})
    return rows


def mgpu_gpu() -> bool:
    from mgpu_launch import backends
    return backends.get_engine().compiles_collectives()


backend = keras.backend.backend()
only = sys.argv[2] if len(sys.argv) > 2 else ""  # "serialization": that part alone
rows = [] if only else {"tensorflow": tensorflow_rows, "torch": torch_rows}[backend]()
if backend == "tensorflow" and mgpu_gpu():
    rows += serialization_rows()
size = mgpu.size()
for row in (r for r in rows if "host_ms_in_call" not in r):
    row["bus_gb_s"] = round(2 * (size - 1) / size * row["mb"] * 1e6 / (row["ms"] * 1e-3) / 1e9, 1)
if mgpu.is_chief():
    for row in rows:
        print(f"[allreduce {backend} np={size}] {row}", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump({"backend": backend, "processes": size, "rows": rows}, f, indent=1)
mgpu.shutdown()
