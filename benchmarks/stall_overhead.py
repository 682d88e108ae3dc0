"""Cost of the stall inspector (or, with ``--timeline``, of the timeline recorder) per training
step: fit with it on and off, alternately, in one job.

    python benchmarks/stall_overhead.py OUT.json [--steps 3000] [--repeats 7] [--units 256]
    mgpu-train -np 2 benchmarks/stall_overhead.py OUT.json [--timeline] ...

With ``--timeline`` the inspector and its probes stay on throughout and "on" means the timeline
recorder records (what the efficiency report, on by default at ``verbose >= 1``, and
``MGPU_TIMELINE`` start); the dispatch figure is then the probes' cost with the recorder on
against off.

On one process (no launcher) "on" means the fit probes (what ``mgpu-train -np 1`` adds for the
restart marker; no inspector thread exists at size 1). On several processes "on" means the
inspector of a real job: probes, the reporter threads and rank 0's monitor. Each repeat runs
an "off" and an "on" fit of STEPS steps, in alternating order, so a change of machine load
hits both. Also times the probes' calls alone (Keras's CallbackList dispatch, 5 x 20k steps).
On a busy machine the fits' spread is far above 0.5%; the probes' own cost per step, against
the fastest step time seen, is then the figure to trust.
Rank 0 writes OUT.json with every fit's seconds per step.
"""

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

import mgpu_launch as mgpu

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=3000)
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--units", type=int, default=256)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--timeline", action="store_true",
                    help="measure the timeline recorder instead of the stall inspector")
args = parser.parse_args()

os.environ["MGPU_PROGRESS_MARKER"] = "1" if args.timeline else "0"  # the script decides
os.environ["MGPU_EFFICIENCY_REPORT"] = "0"  # its recorder would be on in both modes
mgpu.init()
import keras  # noqa: E402

from mgpu_launch import runtime
from mgpu_launch.runtime import stall, timeline
from mgpu_launch.training import stall_probes  # noqa: E402


def set_inspector(on: bool) -> None:
    if args.timeline:  # the recorder: on, or gone (the next start measures the clocks again)
        if on:
            timeline.ensure_recording(runtime.state)
        else:
            timeline.on_shutdown()
        mgpu.barrier()
    elif mgpu.size() > 1:
        if on:
            stall.start(runtime.state)
        else:
            stall.stop()
        mgpu.barrier()
    else:
        os.environ["MGPU_PROGRESS_MARKER"] = "1" if on else "0"


rng = np.random.default_rng(mgpu.rank())
x = rng.normal(size=(args.steps * args.batch, 32)).astype("float32")
y = rng.integers(0, 10, size=args.steps * args.batch)
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(args.units, activation="relu"),
                          keras.layers.Dense(args.units, activation="relu"),
                          keras.layers.Dense(10)])
model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.SGD(0.001)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
set_inspector(False)
model.fit(x[:50 * args.batch], y[:50 * args.batch], batch_size=args.batch, verbose=0)  # warm-up

per_step = {"off": [], "on": []}
for repeat in range(args.repeats):
    for mode in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
        set_inspector(mode == "on")
        if mgpu.size() > 1:
            mgpu.barrier()
        started = time.perf_counter()
        model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
        per_step[mode].append((time.perf_counter() - started) / args.steps)

# The probes alone: what Keras's callback dispatch costs with and without them, per step
# (the fastest of 5 rounds of 20,000 steps, alternating, against the machine's other load).
dispatch = {"off": [], "on": []}
for _ in range(5):
    for mode in ("off", "on"):
        callbacks = [keras.callbacks.History()]
        if args.timeline:
            set_inspector(mode == "on")
        if mode == "on" or args.timeline:
            callbacks = [stall_probes.FirstProbe(), *callbacks, stall_probes.LastProbe()]
        callback_list = keras.callbacks.CallbackList(callbacks, model=model)
        calls = 20_000
        started = time.perf_counter()
        for batch in range(calls):
            callback_list.on_train_batch_begin(batch)
            callback_list.on_train_batch_end(batch)
        dispatch[mode].append((time.perf_counter() - started) / calls)
dispatch = {mode: min(times) for mode, times in dispatch.items()}

if mgpu.rank() == 0:
    off, on = statistics.median(per_step["off"]), statistics.median(per_step["on"])
    pairs = [b / a - 1 for a, b in zip(per_step["off"], per_step["on"])]
    result = {
        "measured": "timeline recorder" if args.timeline else "stall inspector",
        "np": mgpu.size(), "backend": keras.backend.backend(), "keras": keras.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": f"MLP 32-{args.units}-{args.units}-10, batch {args.batch}, SGD",
        "steps_per_fit": args.steps, "repeats": args.repeats,
        "seconds_per_step": per_step, "median_off_ms": off * 1e3, "median_on_ms": on * 1e3,
        "overhead_of_medians_pct": (on / off - 1) * 100,
        "overhead_paired_median_pct": statistics.median(pairs) * 100,
        "min_off_ms": min(per_step["off"]) * 1e3, "min_on_ms": min(per_step["on"]) * 1e3,
        "overhead_of_mins_pct": (min(per_step["on"]) / min(per_step["off"]) - 1) * 100,
        "probe_dispatch_us_per_step": {k: v * 1e6 for k, v in dispatch.items()},
        "probe_cost_us_per_step": (dispatch["on"] - dispatch["off"]) * 1e6,
        "probe_cost_pct_of_fastest_step": (dispatch["on"] - dispatch["off"])
        / min(per_step["off"]) * 100,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "seconds_per_step"}, indent=1))
