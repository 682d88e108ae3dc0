"""``mgpu-bench``: training throughput and scaling of Keras models under mgpu-launch.

    mgpu-bench --model resnet50 --backend jax,torch --precision float32,mixed_bfloat16 \\
        --gpus 1,2 --native --out bench-results
    mgpu-bench --model gpt2-small-lm --precision mixed_bfloat16 --gpus 1 \
        --backend native,native+compile,torch,torch+compile,jax,tensorflow --data device,recipe
    mgpu-bench --cpu --gpus 1,2 --model mlp-tiny --steps 5          # any machine, no GPU

What is measured (the seed study's method): samples per second of ``model.fit`` on
synthetic data of the model's real input shape, summed over the processes, shown in the
model's unit (``unit``, ``rate``: img/s for image models, tokens/s for the transformers, whose
sequences/s are ``img_per_sec``); speedup = rate(N) / rate(1) and efficiency = speedup / N,
always from runs of the SAME invocation
(shared machines drift between invocations). Every GPU count is its own job started through
the launcher (``mgpu-train -np N``), one process per GPU, with ``mgpu.DistributedOptimizer``.

Timing: each rank reads the loss back at the end of the warm-up and every ``--window`` steps
after it (that waits for the device); each window's rate is ``window x batch / seconds``; a
rank's figure is the median window, the job's the sum over ranks.

Every row also has the user's waits (``clock.py``), on the slowest rank, the loss read back:
``first_step_s``, its fit's first train step, compilation included; ``warmup_s``, from the start
of that step to the end of the first step that ran the row's step path as every later step does
(its tracing, compiling and capturing done: the torch engine's compiled step compiles at the
second step, so only ``warmup_s`` holds its compile; JAX and TensorFlow compile at the first;
native+compile: up to the last step in which ``torch.compile`` compiled), with ``ready_step``
its number. The first row of a compiled function carries them. ``step_path`` says what the step
actually ran as (eager, graph, compiled, cuda_graph, compiled+cuda_graph; a fallback to eager
included, its reason in ``step_fallback``); ``compiled`` only says whether ``--compile`` was
given. results.md adds a table of each row's warm-up against native+compile's.

Input (``--data``; several give several rows from one compiled model):
  device  one batch already on the device, every step (input feeding excluded);
  host    numpy batches from a PyDataset, copied to the device by Keras (and by mgpu's
          prefetch thread unless ``--prefetch 0``);
  host-uint8  the same as uint8 pixels (a quarter of the bytes), cast to the model's float
          input inside the compiled step, on the device: what image pipelines ship;
  numpy   ``fit(x, y, batch_size=...)`` on in-memory arrays, shuffled: Keras slices every batch;
  recipe  transformers: the README's keras-hub recipe, ``mgpu.data.shard`` of a ``tf.data`` of
          the token ids (shuffled, batched and prefetched by shard; needs TensorFlow).

Backends (``--backend``, one row name each; ``names.py``): tensorflow, jax, torch,
torch+cudagraph, torch+compile (``jit_compile=True``), mirrored, and the references native
(the model in plain torch, eager, + DistributedDataParallel, data on the device) and
native+compile (``torch.compile`` of its whole step), for every model, on GPUs or ``--cpu``;
``--native`` is the same as adding native.
``--backend ...,mirrored`` adds Keras 3 + tf.distribute.MirroredStrategy: ONE process over the
N GPUs the N-process jobs use, same model, batch per GPU, precision, data modes and timing as the
tensorflow row (``mirrored.py``); with ``--cpu`` it runs at 1 only (one CPU device to mirror).

``--data-format channels_last,channels_first`` runs every job once per image layout
(``keras.config.set_image_data_format`` before the model is built; the native row keeps its
tensors in torch.channels_last memory vs contiguous NCHW); one row per format.

Output under ``--out``: ``results.json`` (a header with machine, devices, versions, command,
date, method; a list of rows), ``results.md`` and ``results.png`` (speedup and efficiency vs
GPUs against the ideal line), and the console table. ``logs/`` keeps every job's output.
``results.json`` is rewritten after every job: ``--resume`` with the same options and ``--out``
finishes an invocation that was cut short, on the same machine (``resume.py``).
Exit status: 0 when every run succeeded, 1 when one failed (the others are still reported),
2 for a bad command line or a ``--resume`` that cannot continue what ``--out`` holds.
"""

import argparse
import datetime
import os
import platform
import secrets
import shlex
import subprocess
import signal
import sys
import time
from typing import Dict, List, Optional

from mgpu_launch.config import devices
from mgpu_launch.bench import jobs, names, report, result_file, resume
from mgpu_launch.bench.models import MODELS
from mgpu_launch.bench.worker import DATA_FORMATS
from mgpu_launch.runtime import folders

BACKENDS = names.BACKENDS
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
DATA_MODES = result_file.DATA_MODES


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit code 2 with the usage, like argparse, plus a hint
        self.print_usage(sys.stderr)
        self.exit(2, f"mgpu-bench: error: {message}\n(mgpu-bench --help lists every option)\n")


def get_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mgpu-bench", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    add = parser.add_argument
    add("--model", default="resnet50",
        help=f"comma-separated, of: {', '.join(MODELS)} (default: %(default)s)")
    add("--backend", default=os.environ.get("KERAS_BACKEND", "tensorflow"),
        help=f"comma-separated, of: {', '.join(BACKENDS)}: Keras backends under mgpu "
             f"(torch+cudagraph: the step in a CUDA graph; torch+compile: jit_compile=True), "
             f"the native torch references (native: eager; native+compile: torch.compile of "
             f"the step) and mirrored (Keras-TF + tf.distribute.MirroredStrategy, one process "
             f"over the same GPUs); default: KERAS_BACKEND, else tensorflow")
    add("--precision", default="float32",
        help=f"comma-separated Keras dtype policies, of: {', '.join(PRECISIONS)}")
    add("--gpus", default="1,2", help="process counts, comma-separated (default: %(default)s)")
    add("--batch-per-gpu", type=int, help="samples per step per process (default: the model's)")
    add("--steps", type=int, default=40, help="timed steps (default: %(default)s)")
    add("--warmup-steps", type=int, default=10, help="untimed steps first (default: %(default)s)")
    add("--window", type=int, default=5, help="steps per timing window (default: %(default)s)")
    add("--data", default="host",
        help=f"comma-separated input modes, of: {', '.join(DATA_MODES)}")
    add("--data-format", default="channels_last",
        help=f"comma-separated Keras image data formats, of: {', '.join(DATA_FORMATS)}; one "
             f"row each (default: %(default)s)")
    add("--prefetch", default="2",
        help="comma-separated MGPU_PREFETCH depths (0 = Keras's own feeding; default: 2)")
    add("--cuda-graph", default="0",
        help="torch backend: comma-separated MGPU_TORCH_CUDA_GRAPH values; 0,1 measures the "
             "eager step and the step captured in a CUDA graph in the same job (default: 0)")
    add("--native", action="store_true",
        help="also run the model in plain torch + DDP, eager (torchvision for resnet50 and "
             "inceptionv3); the same as adding native to --backend")
    add("--steps-per-execution", default="1",
        help="comma-separated Keras steps_per_execution values, one row each (default: 1)")
    add("--recorder", default="on",
        help="off,on (or off,on,off,on: alternated, against drift): rows with the timeline "
             "recorder off (MGPU_EFFICIENCY_REPORT=0) and on: what it costs; an on row keeps its "
             "efficiency report and writes its trace to logs/ (default: on, what users get)")
    add("--shard-optimizer-state", default="0",
        help="comma-separated 0/1: rows with the optimizer state replicated on every rank (0) "
             "and sharded across the ranks (1, DistributedOptimizer(shard_optimizer_state="
             "True)); every row reports the bytes of optimizer state per rank (default: 0)")
    add("--compression", default="none", choices=["none", "fp16", "bf16"],
        help="the gradients' wire format (mgpu.Compression; default: %(default)s)")
    add("--profile", action="store_true",
        help="per rank, where the step time goes: input, waiting for other ranks, step, and "
             "(JAX, TensorFlow) the exposed allreduce; an extra fit per input mode "
             "(mgpu_launch/bench/profile.py)")
    add("--cpu", action="store_true",
        help="run on CPU processes (no GPU needed; use a small model such as mlp-tiny)")
    add("--timeout", type=float, default=900, help="seconds per job (default: %(default)s)")
    add("--out", default="bench-results", help="output folder (default: %(default)s)")
    add("--resume", action="store_true",
        help="finish an invocation cut short: jobs whose result is in --out already are not "
             "run again (same options and machine only; mgpu_launch/bench/resume.py)")
    return parser


def _split(parser, option: str, value: str, allowed=None, kind=str) -> list:
    try:
        items = [kind(item) for item in value.split(",") if item.strip()]
    except ValueError:
        parser.error(f"{option} {value!r}: expected comma-separated integers, e.g. 1,2")
    if not items:
        parser.error(f"{option} {value!r}: expected at least one value")
    bad = [item for item in items if allowed is not None and item not in allowed]
    if bad:
        parser.error(f"{option} {value!r}: unknown {', '.join(map(str, bad))}; expected "
                     f"one or more of: {', '.join(map(str, allowed))}")
    return items


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the command line; a bad one exits with status 2 and says why."""
    parser = get_parser()
    args = parser.parse_args(argv)
    args.options = {key: value for key, value in vars(args).items()
                    if key not in resume.NOT_COMPARED}
    args.models = _split(parser, "--model", args.model, MODELS)
    args.backends = _split(parser, "--backend", args.backend, BACKENDS)
    args.precisions = _split(parser, "--precision", args.precision, PRECISIONS)
    args.gpu_counts = sorted(set(_split(parser, "--gpus", args.gpus, kind=int)))
    args.data_modes = _split(parser, "--data", args.data, DATA_MODES)
    args.data_formats = _split(parser, "--data-format", args.data_format, DATA_FORMATS)
    args.prefetch_depths = _split(parser, "--prefetch", args.prefetch, kind=int)
    args.cuda_graphs = _split(parser, "--cuda-graph", args.cuda_graph, ("0", "1"))
    args.executions = _split(parser, "--steps-per-execution", args.steps_per_execution, kind=int)
    args.recorders = _split(parser, "--recorder", args.recorder, ("off", "on"))
    args.shardings = _split(parser, "--shard-optimizer-state", args.shard_optimizer_state,
                            ("0", "1"))
    if min(args.executions) < 1:
        parser.error(f"--steps-per-execution {args.steps_per_execution!r}: expected integers "
                     f">= 1, e.g. 1,8")
    if min(args.gpu_counts) < 1 or min(args.prefetch_depths) < 0:
        parser.error(f"--gpus {args.gpus!r} / --prefetch {args.prefetch!r}: expected process "
                     f"counts >= 1 and prefetch depths >= 0")
    if args.batch_per_gpu is not None and args.batch_per_gpu < 1:
        parser.error(f"--batch-per-gpu {args.batch_per_gpu}: expected >= 1")
    if args.window < 1 or args.steps < args.window or args.warmup_steps < 1:
        parser.error(f"--steps {args.steps} --window {args.window} --warmup-steps "
                     f"{args.warmup_steps}: need at least one timed window (steps >= window "
                     f">= 1) after at least one warm-up step (it compiles the model)")
    if args.native and "native" not in args.backends:
        args.backends.append("native")
    images = [m for m in args.models if MODELS[m].transformer is None]
    tokens = [m for m in args.models if MODELS[m].transformer is not None]
    if "recipe" in args.data_modes and (images or "mirrored" in args.backends):
        parser.error(f"--data recipe: the keras-hub recipe (mgpu.data.shard of a tf.data of "
                     f"token ids) is for the transformer models "
                     f"({', '.join(m for m in MODELS if MODELS[m].transformer)}) under mgpu; "
                     f"got --model {','.join(images) or args.model}"
                     f"{' and mirrored' if 'mirrored' in args.backends else ''}: leave "
                     f"recipe out or run those in another invocation")
    if "host-uint8" in args.data_modes and tokens:
        parser.error(f"--data host-uint8: uint8 pixels are for image models, and "
                     f"{', '.join(tokens)} takes token ids; use host (or device, recipe)")
    if not args.cpu:
        gpus = devices.visible_gpus()
        if max(args.gpu_counts) > len(gpus):
            parser.error(
                f"--gpus {args.gpus}: asked for {max(args.gpu_counts)} GPUs, but this machine "
                f"shows {len(gpus)} (CUDA_VISIBLE_DEVICES / the NVIDIA driver). Ask for at "
                f"most {len(gpus)}, or add --cpu to run CPU processes instead.")
    return args


def run_all(args) -> int:
    """Run every job, then write the JSON, markdown and plot. Returns the exit status."""
    to_run, rows, failed, workers, args.skipped, args.reused = [], [], [], {}, [], []
    args.invocation, args.digests = secrets.token_hex(16), {}
    try:  # --out may be shared (a relative default in /tmp): only a folder of this user's
        out = folders.private_folder(args.out, "--out")
        folders.private_folder(os.path.join(out, "logs"), "--out's logs folder")
        previous = args.resume and resume.previous_header(
            out, args.options, platform.node(), None if args.cpu else _gpu_names())
    except (resume.ResumeError, OSError) as error:
        print(f"mgpu-bench: {error}", file=sys.stderr)
        return 2
    if args.resume:
        print(f"resuming the invocation of {previous['date']} in {args.out}" if previous else
              f"--resume: no results in {args.out} yet, running every job", flush=True)
    for job in jobs.plan(args):
        reason = jobs.skip_reason(args, job[0], job[-1])
        if reason:
            args.skipped.append(jobs.job_label(*job))
            layout = "" if job[3] == "channels_last" else f" {job[3]}"
            print(f"skipped {job[0]} {job[1]} {job[2]}{layout} on {job[4]} processes: {reason}",
                  flush=True)
        else:
            to_run.append(job)
    started_all = time.monotonic()
    for number, (backend, model, precision, data_format, gpus) in enumerate(to_run, 1):
        label = jobs.job_label(backend, model, precision, data_format, gpus)
        result = os.path.join(out, "logs", f"{label}.json")
        fresh = jobs.result_path(os.path.join(out, "logs"), label, args.invocation)
        log = os.path.join(out, "logs", f"{label}.log")
        layout = "" if data_format == "channels_last" else f" {data_format}"
        print(f"[{number}/{len(to_run)}] {backend} {model} {precision}{layout} on {gpus} "
              f"{'process' if args.cpu else 'GPU'}{'es' if args.cpu and gpus > 1 else ''}"
              f"{'' if args.cpu or gpus == 1 else 's'} ...", flush=True)
        started = time.monotonic()
        measured = previous and resume.reusable(previous, label, result)
        if measured:
            args.reused.append(label)
            print(f"    reused from {previous['date']}: {result}", flush=True)
            status = 0
        else:
            for stale in [result] + jobs.stale_results(os.path.join(out, "logs"), label):
                if os.path.lexists(stale):  # an earlier call's: the job writes its own
                    os.unlink(stale)
            status = jobs.run(jobs.command(args, backend, model, precision, data_format, gpus,
                                           fresh),
                              jobs.environment(args, backend, gpus), log, args.timeout)
        try:
            if status == 0 and not measured:  # this run's own file, then under the job's name
                measured = result_file.read(fresh)
                os.replace(fresh, result)
                jobs.claim_traces(fresh, result)
        except (OSError, ValueError) as error:
            status = f"0, but its result is unusable: {error}"
        if status != 0:
            failed.append(label)
            print(f"    FAILED (exit {status}) after {time.monotonic() - started:.0f} s; the "
                  f"job's output: {log}", flush=True)
            continue
        measured, args.digests[label] = measured
        workers.setdefault(backend, measured)
        for row in measured["rows"]:
            if isinstance(row.get("timeline"), str):  # as the job wrote it, under its run's name
                row = dict(row, timeline=jobs.trace_name(row["timeline"]))
            shown = names.row_backend(backend, row)  # says so when capture failed
            rows.append(dict(row, backend=shown, precision=precision, gpus=gpus))
            variant = f", {row['variant']}" if row.get("variant") else ""
            print(f"    {shown} {row['data']}{layout}, prefetch {row['prefetch']}{variant}: "
                  f"{report.rate_words(row)}", flush=True)
        print(f"    done in {time.monotonic() - started:.0f} s", flush=True)
        if number < len(to_run):  # keep what is measured if the invocation is cut short
            report.add_scaling(rows)
            report.write(out, make_header(args, workers, time.monotonic() - started_all),
                         rows, with_plot=False)
    report.add_scaling(rows)
    header = make_header(args, workers, time.monotonic() - started_all)
    paths = report.write(out, header, rows)
    print(report.console_table(rows))
    print("wrote " + ", ".join(paths))
    if failed:
        print(f"mgpu-bench: {len(failed)} of {len(to_run)} jobs failed: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def _gpu_names() -> Optional[List[str]]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()] or None


def make_header(args, workers: Dict[str, dict], seconds: float) -> dict:
    """Where and how the figures were taken: machine, devices, versions, command, date."""
    return {
        "tool": "mgpu-bench",
        "command": shlex.join(["mgpu-bench"] + sys.argv[1:]) if sys.argv[1:] else "mgpu-bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cpu_count": os.cpu_count(),
        "gpus": None if args.cpu else _gpu_names(),
        "mode": "cpu processes" if args.cpu else "one process per GPU",
        "device": {backend: w.get("device") for backend, w in workers.items()},
        "versions": {backend: w.get("versions") for backend, w in workers.items()},
        "method": (f"model.fit on synthetic data; per rank the median of "
                   f"{args.steps // args.window} windows of {args.window} steps after "
                   f"{args.warmup_steps} warm-up steps (loss read back per window); samples/s "
                   f"summed over ranks, shown in the model's unit (img/s, tokens/s); speedup "
                   f"and efficiency against 1 process of the same invocation; first_step_s: "
                   f"the fit's first train step, compilation included, slowest rank" + (
                       "; mirrored: one process, tf.distribute.MirroredStrategy over the first "
                       "N GPUs (the CPU at 1 with --cpu), global batch N x batch per GPU, Keras's "
                       "default jit_compile" if "mirrored" in args.backends else "")),
        "skipped": getattr(args, "skipped", []),
        "reused": getattr(args, "reused", []),  # --resume: jobs measured by an earlier call
        "options": args.options,
        # --resume reuses only results recorded here: this call's key, each file's SHA-256
        "invocation": getattr(args, "invocation", None),
        "results": dict(getattr(args, "digests", {})),
        "seconds": round(seconds),
    }


def main(argv=None) -> int:
    """The ``mgpu-bench`` console script (also ``python -m mgpu_launch.bench``).

    Ctrl-C or SIGTERM stops the running job first (see :mod:`mgpu_launch.bench.jobs`), then
    the bench, with 128 + the signal's number and no traceback; ``results.json`` keeps the jobs
    done before, for ``--resume``.
    """
    args = parse_args(argv)
    try:
        return run_all(args)
    except (jobs.Stopped, KeyboardInterrupt) as error:
        signum = getattr(error, "signum", signal.SIGINT)
        print(f"mgpu-bench: stopped by {signal.Signals(signum).name}; the running job was "
              f"stopped too (the jobs done before are in {args.out}: finish with --resume)",
              file=sys.stderr, flush=True)
        return 128 + signum
