"""Host time of the torch engine's synchronous fused allreduce, per call (CPU, gloo).

    KERAS_BACKEND=torch mgpu-train -np 2 benchmarks/torch_allreduce_python_cost.py [CALLS]

ResNet-50's 161 gradient shapes, scaled down to 1/1000 of their elements so the transfer is
small and the Python around it (grouping into buckets, scaling, splitting) shows: what the
reduction-plan refactor of issue 30 could have changed. Rank 0 prints one JSON line: the
median and best per-call time over rounds of CALLS calls.
"""

import json
import statistics
import sys
import time

import mgpu_launch as mgpu

mgpu.init()
import keras  # noqa: E402
import torch  # noqa: E402

from mgpu_launch import backends  # noqa: E402

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 200
model = keras.applications.ResNet50(weights=None)
tensors = [torch.ones(max(1, v.value.numel() // 1000)) for v in model.trainable_variables]
engine = backends.get_engine()
for _ in range(20):
    engine.allreduce(tensors, average=True)
rounds = []
for _ in range(7):
    start = time.perf_counter()
    for _ in range(calls):
        engine.allreduce(tensors, average=True)
    rounds.append((time.perf_counter() - start) / calls * 1e3)
if mgpu.rank() == 0:
    print(json.dumps({"tensors": len(tensors), "elements": sum(t.numel() for t in tensors),
                      "calls": calls, "median_ms": round(statistics.median(rounds), 4),
                      "best_ms": round(min(rounds), 4), "code": mgpu.__file__}))
