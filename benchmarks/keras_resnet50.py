"""Training throughput of Keras ResNet-50 under mgpu-launch: np=1 and np=2 in one invocation.

    python benchmarks/keras_resnet50.py --backend jax --precision float32,mixed_bfloat16 \\
        --gpus 1,2 --out results/

For each precision and process count it starts ``mgpu-train -np N`` on this same file (worker
mode). Every rank builds ResNet-50 (weights=None, 224x224x3, 1000 classes), compiles it with
``mgpu.DistributedOptimizer(SGD(momentum=0.9))`` and runs ``model.fit`` on synthetic
ImageNet-shaped data, twice with the same compiled step:

- ``device``: a PyDataset returning one batch already resident on the process's device (what
  the step itself can do, input feeding excluded);
- ``host``: a PyDataset returning numpy batches (rotating among 4), which Keras copies to the
  device every step (what a plain ``fit`` on host data gets).

Timing: the loss is read back every ``--window`` steps (that waits for the device); the rate of
each window after ``--warmup-steps`` is ``window x batch / seconds``; a rank's figure is the
median window rate and the job's img/s is the sum over ranks. Scaling efficiency =
img/s(N) / (N x img/s(1)), from runs of the same invocation only.

Writes ``results.json`` (a header with machine, devices, versions, command, date; one row per
backend/precision/data/gpus) and ``results.md`` under ``--out``, and prints the table.
The ``mgpu-bench`` issue grows this into the full tool; ``--model small-cnn --image-size 32``
is the CPU smoke test the suite runs.
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="jax", choices=("jax", "tensorflow", "torch"))
    parser.add_argument("--precision", default="float32,mixed_bfloat16",
                        help="comma-separated Keras dtype policies (default: %(default)s)")
    parser.add_argument("--gpus", default="1,2", help="process counts, comma-separated")
    parser.add_argument("--data", default="device,host", help="input modes: device, host")
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "small-cnn"))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-per-gpu", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=5, help="steps per timing window")
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = get_parser()
    args = parser.parse_args(argv)
    try:
        args.precisions = [p for p in args.precision.split(",") if p]
        args.gpu_counts = [int(n) for n in args.gpus.split(",") if n]
        args.data_modes = [d for d in args.data.split(",") if d]
    except ValueError:
        parser.error(f"--gpus {args.gpus!r}: expected comma-separated integers, e.g. 1,2")
    bad = set(args.data_modes) - {"device", "host"}
    if bad or not args.data_modes:
        parser.error(f"--data {args.data!r}: expected device, host or both")
    if not args.gpu_counts or min(args.gpu_counts) < 1:
        parser.error(f"--gpus {args.gpus!r}: expected positive process counts")
    if args.steps < args.window or args.warmup_steps % args.window:
        parser.error(f"--steps must be >= --window and --warmup-steps a multiple of it "
                     f"(got {args.steps}, {args.warmup_steps}, {args.window})")
    return args


# -- worker: one rank of one run -------------------------------------------------------------
def build_model(keras, name: str, size: int):
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3),
                                           classes=1000)
    return keras.Sequential([
        keras.Input((size, size, 3)),
        keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(1000, activation="softmax")])


def run_worker(args) -> None:
    import mgpu_launch as mgpu
    mgpu.init()
    import keras
    import numpy as np

    keras.mixed_precision.set_global_policy(args.precision)
    model = build_model(keras, args.model, args.image_size)
    model.compile(optimizer=mgpu.DistributedOptimizer(
        keras.optimizers.SGD(mgpu.scale_lr(0.0125), momentum=0.9)),
        loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(mgpu.rank())
    batch, size = args.batch_per_gpu, args.image_size
    host = [(rng.random((batch, size, size, 3), dtype=np.float32),
             rng.integers(0, 1000, (batch,)).astype("int32")) for _ in range(4)]
    steps = args.warmup_steps + args.steps

    class Batches(keras.utils.PyDataset):
        def __init__(self, on_device):
            super().__init__()
            self.batches = ([tuple(keras.ops.convert_to_tensor(a) for a in host[0])]
                            if on_device else host)

        def __len__(self):
            return steps

        def __getitem__(self, index):
            return self.batches[index % len(self.batches)]

    class WindowTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.stamps = []

        def on_train_batch_end(self, step, logs=None):
            if (step + 1) % args.window == 0:
                float(logs["loss"])  # waits for the device
                self.stamps.append(((step + 1), time.perf_counter()))

    per_mode = {}
    for mode in args.data_modes:
        timer = WindowTimer()
        model.fit(Batches(mode == "device"), epochs=1, verbose=0, callbacks=[timer])
        timed = [(s1, t1, t0) for (s0, t0), (s1, t1) in zip(timer.stamps, timer.stamps[1:])
                 if s0 >= args.warmup_steps]
        rates = [args.window * batch / (t1 - t0) for _, t1, t0 in timed]
        per_mode[mode] = mgpu.allgather_object(statistics.median(rates))
    if mgpu.is_chief():
        with open(args.worker, "w") as f:
            json.dump({"per_rank_img_per_sec": per_mode, "versions": versions(keras),
                       "device": device_name(keras)}, f)


def versions(keras) -> dict:
    import numpy
    found = {"python": platform.python_version(), "keras": keras.__version__,
             "numpy": numpy.__version__}
    backend = keras.backend.backend()
    found[backend] = __import__(backend).__version__
    return found


def device_name(keras) -> str:
    if keras.backend.backend() == "jax":
        import jax
        return jax.local_devices()[0].device_kind
    if keras.backend.backend() == "torch":
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return "unknown"


# -- driver: all runs, one table ----------------------------------------------------------------
def run_all(args) -> int:
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    rows, header = [], None
    for precision in args.precisions:
        single = {}
        for gpus in args.gpu_counts:
            label = f"{args.backend}-{precision}-np{gpus}"
            result_path = os.path.join(args.out, f"{label}.json")
            command = [sys.executable, "-m", "launcher", "-np", str(gpus), os.path.abspath(__file__),
                       "--worker", result_path, "--precision", precision] + _worker_flags(args)
            print(f"[bench] {label}: running ({len(rows)} rows so far)", flush=True)
            started = time.monotonic()
            with open(os.path.join(args.out, "logs", f"{label}.log"), "w") as log:
                status = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        env=dict(os.environ, KERAS_BACKEND=args.backend)).returncode
            if status != 0:
                print(f"[bench] {label}: FAILED (exit {status}); see "
                      f"{os.path.join(args.out, 'logs', label + '.log')}", file=sys.stderr)
                return 1
            with open(result_path) as f:
                result = json.load(f)
            header = header or make_header(args, result)
            for mode, per_rank in result["per_rank_img_per_sec"].items():
                total = sum(per_rank)
                single.setdefault(mode, total if gpus == 1 else None)
                base = single.get(mode)
                rows.append({"backend": args.backend, "precision": precision, "model": args.model,
                             "data": mode, "batch_per_gpu": args.batch_per_gpu, "gpus": gpus,
                             "img_per_sec": round(total, 1),
                             "per_rank_img_per_sec": [round(r, 1) for r in per_rank],
                             "efficiency": round(total / (gpus * base), 4) if base else None})
            print(f"[bench] {label}: done in {time.monotonic() - started:.0f} s", flush=True)
    write_results(args.out, header, rows)
    return 0


def _worker_flags(args):
    return ["--model", args.model, "--image-size", str(args.image_size), "--batch-per-gpu",
            str(args.batch_per_gpu), "--steps", str(args.steps), "--warmup-steps",
            str(args.warmup_steps), "--window", str(args.window), "--data", args.data]


def make_header(args, result) -> dict:
    return {"machine": platform.node(), "device": result["device"],
            "versions": result["versions"], "date": datetime.date.today().isoformat(),
            "command": shlex.join(["python3",
                                   os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
            "timing": f"median over {args.steps // args.window} windows of {args.window} steps "
                      f"after {args.warmup_steps} warm-up steps; img/s summed over ranks"}


def write_results(out: str, header: dict, rows: list) -> None:
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    lines = ["| backend | precision | data | gpus | img/s | per rank | efficiency |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        eff = f"{100 * r['efficiency']:.1f}%" if r["efficiency"] is not None else "-"
        lines.append(f"| {r['backend']} | {r['precision']} | {r['data']} | {r['gpus']} | "
                     f"{r['img_per_sec']:.0f} | {', '.join(f'{x:.0f}' for x in r['per_rank_img_per_sec'])} "
                     f"| {eff} |")
    table = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(f"- {k}: {v}" for k, v in header.items()) + "\n\n" + table + "\n")
    print(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        args.precision = args.precisions[0]
        run_worker(args)
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
