"""One rank of one mgpu-bench job (started by ``mgpu-bench`` through the launcher).

    mgpu-train -np 2 -m mgpu_launch.bench.worker --result r.json --model resnet50 \\
        --precision float32 --data host,device --prefetch 2

Builds the model once, compiles it with ``mgpu.DistributedOptimizer`` of the model's optimizer
(``models.py``: SGD with momentum 0.9, AdamW for the transformers; ``--compile``:
``jit_compile=True``, Keras's ``torch.compile`` path on torch; once per
``--shard-optimizer-state`` value) and runs ``model.fit`` once per input mode and prefetch depth
on synthetic data; rank 0 writes the per-rank rates, and the bytes of optimizer state each rank
held, to ``--result``. Lines with ``[mgpu-bench]`` are progress for the driver.

Every row has its throughput in the model's unit (``unit``: img/s, samples/s or tokens/s;
``rate``) beside ``img_per_sec`` (samples per second, whatever the model), and
the user's waits (``clock.py``): ``first_step_s``, the fit's first train step, and ``warmup_s``, to
the end of the first step that ran the row's step path as the later steps do (its tracing,
compiling and capturing done; ``ready_step`` is that step's number). ``step_path`` is what the
engine actually ran (``eager``, ``graph``, ``compiled``, ``cuda_graph``,
``compiled+cuda_graph``; ``Engine.step_path``), and ``step_fallback`` why it runs a slower path
than asked for (the fallback line's reason) or null; ``compiled`` is only whether ``--compile``
was given. The first row of each train function carries its tracing and compilation; later
rows reuse the compiled step.
"""

import argparse
import json
import os
import platform
import time

import mgpu_launch as mgpu
from mgpu_launch import backends, runtime
from mgpu_launch.bench import profile
from mgpu_launch.bench.clock import StepTimer, make_window_timer, median_rate, timing_for, waits
from mgpu_launch.bench.models import MODELS
from mgpu_launch.runtime import folders, timeline


DATA_FORMATS = ("channels_last", "channels_first")


def get_parser(description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """The options every mgpu-bench rank takes (the driver passes them; native and mirrored
    read the same ones)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--result", required=True)
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--batch-per-gpu", type=int)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--data", default="host")
    parser.add_argument("--prefetch", default="2")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    parser.add_argument("--cuda-graph", default="0",
                        help="torch: comma-separated MGPU_TORCH_CUDA_GRAPH values (0, 1)")
    parser.add_argument("--compile", action="store_true",
                        help="Keras rows: model.compile(jit_compile=True) (and "
                             "MGPU_TORCH_COMPILE=1 on torch); native rows: torch.compile of "
                             "the step")
    parser.add_argument("--data-format", default="channels_last", choices=DATA_FORMATS,
                        help="keras.config.set_image_data_format before the model is built")
    parser.add_argument("--steps-per-execution", default="1",
                        help="comma-separated: one row per value (the model's "
                             "steps_per_execution, its train function rebuilt)")
    parser.add_argument("--shard-optimizer-state", default="0",
                        help="comma-separated 0/1: one set of rows each with the optimizer "
                             "compiled unsharded / with shard_optimizer_state=True")
    parser.add_argument("--recorder", default="on",
                        help="comma-separated off/on, in order (off,on,off,on alternates): one "
                             "row each with the timeline recorder "
                             "(the efficiency report, MGPU_EFFICIENCY_REPORT) off / on; an on "
                             "row keeps its report and writes its trace beside --result")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return get_parser().parse_args(argv)


def progress(message: str) -> None:
    if mgpu.is_chief():
        print(f"[mgpu-bench] {message}", flush=True)


def synthetic_batches(np, spec, shape, batch: int, seed: int) -> dict:
    """Four random (x, y) batches of `shape` per input mode: ``host`` (float32 inputs, or a
    transformer's token ids) and, for image and vector models, ``host-uint8`` pixels (what
    image pipelines ship: a quarter of the bytes; the model's float input layer casts them
    inside the compiled step, on the device)."""
    rng = np.random.default_rng(seed)
    host = [spec.synthetic(np, shape, batch, rng) for _ in range(4)]
    if spec.transformer is not None:
        return {"host": host}
    return {"host": host, "host-uint8": [((x * 255).astype(np.uint8), y) for x, y in host]}


def throughput_fields(spec, samples_per_sec: float) -> dict:
    """A row's throughput in the model's own unit: ``unit``, ``rate`` and, for transformers,
    ``tokens_per_sample`` (rate = samples/s x tokens per sequence)."""
    tokens = spec.tokens_per_sample
    fields = {"unit": spec.unit, "rate": round(samples_per_sec * (tokens or 1), 1)}
    if tokens:
        fields["tokens_per_sample"] = tokens
    return fields


def recipe_dataset(np, spec, shape, batch: int, batches: int):
    """The README's keras-hub recipe as the ``recipe`` input mode: one ``tf.data`` of every
    rank's sequences (the same on every rank, seeded), through ``mgpu.data.shard`` (shuffled,
    batched, prefetched): `batches` batches of `batch` for this rank."""
    import tensorflow as tf
    rng = np.random.default_rng(0)
    x, y = spec.synthetic(np, shape, batch * batches * mgpu.size(), rng)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    return mgpu.data.shard(dataset, batch_size=batch, shuffle=True, seed=1)


def main(argv=None) -> None:
    args = parse_args(argv)
    mgpu.init()  # before Keras touches a device (JAX)
    import keras
    import numpy as np

    from mgpu_launch.training import efficiency, efficiency_report, sharding  # import Keras

    spec = MODELS[args.model]
    batch = args.batch_per_gpu or spec.batch_per_gpu
    keras.mixed_precision.set_global_policy(args.precision)
    keras.config.set_image_data_format(args.data_format)  # before any layer is built
    started = time.monotonic()
    model = spec.build(keras, spec.shape(args.data_format))
    arguments = spec.compile_arguments(keras, learning_rate_scale=mgpu.size())
    if args.compile and keras.backend.backend() == "torch":
        os.environ["MGPU_TORCH_COMPILE"] = "1"  # mgpu's compiled torch step, where it has one


    def compile_model(shard: bool) -> None:
        # a fresh optimizer of the model's kind each time (the weights stay)
        fresh = spec.compile_arguments(keras, learning_rate_scale=mgpu.size())["optimizer"]
        model.compile(optimizer=mgpu.DistributedOptimizer(
            fresh, compression=getattr(mgpu.Compression, args.compression),
            shard_optimizer_state=shard),
            loss=arguments["loss"], **({"jit_compile": True} if args.compile else {}))

    shape = spec.shape(args.data_format)
    synthetic = synthetic_batches(np, spec, shape, batch, seed=mgpu.rank())
    host, host_uint8 = synthetic["host"], synthetic.get("host-uint8")
    progress(f"{args.model} built ({model.count_params() / 1e6:.2f}M parameters) in "
             f"{time.monotonic() - started:.0f} s; {args.warmup_steps + args.steps} steps per "
             f"input mode, batch {batch} per process")

    class Batches(keras.utils.PyDataset):
        def __init__(self, mode: str, total: int):
            super().__init__()
            self.total = total
            self.batches = {"device": [keras.tree.map_structure(keras.ops.convert_to_tensor,
                                                                host[0])],
                            "host": host, "host-uint8": host_uint8}[mode]

        def __len__(self):
            return self.total

        def __getitem__(self, index):
            return self.batches[index % len(self.batches)]

    def fit(mode: str, total: int, callbacks) -> None:
        if mode == "numpy":
            x, y = keras.tree.map_structure(lambda *parts: np.concatenate(parts), *[
                host[index % len(host)] for index in range(total)])
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=True, verbose=0,
                      callbacks=callbacks)
        elif mode == "recipe":
            model.fit(recipe_dataset(np, spec, shape, batch, total), epochs=1, verbose=0,
                      callbacks=callbacks)
        else:
            model.fit(Batches(mode, total), epochs=1, verbose=0, callbacks=callbacks)

    engine = backends.get_engine()

    def rate(mode: str, timing, recorded: bool) -> tuple:
        """(this rank's samples/s, its window timer (the waits), the efficiency report's text
        on rank 0 of a recorded row)."""
        total = timing.warmup_steps + timing.steps
        timer = make_window_timer(keras, timing, total, progress,
                                  ready=lambda: engine.step_path(model).ready)
        kind = {"recipe": "shard tf.data", "numpy": "arrays"}.get(mode, "PyDataset")
        report = efficiency_report.EfficiencyReport(batch, kind) if recorded else None
        step_timer.reset()
        fit(mode, total, [timer] + ([report] if report else []))
        text = efficiency.render(report.figures) if report and report.figures else None
        return median_rate(timer.stamps, timing.window, batch), timer, text

    def profiled(mode: str, timing) -> dict:
        """Per rank input / wait / step ms (and compute ms where the allreduce can be left out)."""
        total = timing.warmup_steps + timing.steps
        clock = profile.make_callback(keras, timing.warmup_steps)
        fit(mode, total, [clock])
        ranks = profile.breakdown(clock.steps)
        if profile.skip_allreduce(model, True):
            progress(f"data {mode}: profile without the allreduce (recompiles)")
            alone = profile.make_callback(keras, timing.warmup_steps)
            fit(mode, total, [alone])
            profile.skip_allreduce(model, False)
            for mine, without in zip(ranks, profile.breakdown(alone.steps)):
                mine["compute_ms"] = without["own_ms"]
                # two medians of separate fits: on a loaded box the step without the
                # allreduce can come out slower; the exposed allreduce is then none, not < 0
                mine["comm_ms"] = round(max(0.0, mine["step_ms"] - without["own_ms"]), 2)
        return {"per_rank_profile": ranks}

    rows = []
    step_timer = StepTimer(keras.backend.backend())
    graphs = args.cuda_graph.split(",") if keras.backend.backend() == "torch" else ["0"]
    compiled_with = None  # the shard_optimizer_state the model is compiled with
    # Captured rows first: a step captured after eager steps of the same model can fail to
    # capture (ResNet-50, benchmarks/torch_speed/h200-2026-11-27/eager_then_capture_resnet.log).
    graphs.sort(key=lambda graph: graph != "1")
    # In the order given (off,on,off,on alternates); repeats are numbered in the row's variant.
    recorders = args.recorder.split(",")
    labels = [f"recorder {r}" + (f" #{recorders[:i + 1].count(r)}"
                                 if recorders.count(r) > 1 else "")
              for i, r in enumerate(recorders)] if len(recorders) > 1 else [""] * len(recorders)
    for shard, graph, executions in [(h == "1", g, int(k))
                                     for h in args.shard_optimizer_state.split(",")
                                     for g in graphs
                                     for k in args.steps_per_execution.split(",")]:
        if shard is not compiled_with:
            compile_model(shard)  # a fresh optimizer (the weights stay)
            compiled_with = shard
        os.environ["MGPU_TORCH_CUDA_GRAPH"] = graph
        model.steps_per_execution = executions
        timing = timing_for(args, executions)
        model.make_train_function(force=True)
        graphed = model.train_function  # a GraphedTrainStep when capture is on (torch)
        model.train_function = step_timer.wrap(graphed)
        for mode in args.data.split(","):
            depths = [int(d) for d in args.prefetch.split(",")]
            for depth, recorder, label in [
                    (d, r, lab) for d in (depths[:1] if mode == "device" else depths)
                    for r, lab in zip(recorders, labels)]:
                os.environ["MGPU_PREFETCH"] = str(depth)
                os.environ["MGPU_EFFICIENCY_REPORT"] = "1" if recorder == "on" else "0"
                if recorder == "off":
                    timeline.discard()  # an earlier on row started it
                variant = ", ".join(filter(None, [
                    label, "optimizer state sharded" if shard else "",
                    f"steps_per_execution {executions}" if executions > 1 else ""])) or None
                name = f"data {mode}, prefetch {depth}, cuda graph {graph}" + (
                    f", {variant}" if variant else "")
                progress(f"{name}: fit")
                mine, timer, text = rate(mode, timing, recorder == "on")
                per_rank = mgpu.allgather_object(mine)
                wait = waits(timer.first_step, timer.warmup, timer.ready_step,
                             mgpu.allgather_object)
                path = engine.step_path(model)
                state_bytes = mgpu.allgather_object(sharding.state_bytes(model.optimizer))
                host_ms, device_ms = step_timer.medians()
                rows.append({"model": args.model, "data": mode, "prefetch": depth,
                             "compression": args.compression, "variant": variant,
                             "recorder": recorder == "on", "steps_per_execution": executions,
                             "data_format": keras.config.image_data_format(),
                             "batch_per_gpu": batch, "params": model.count_params(),
                             "img_per_sec": round(sum(per_rank), 1),
                             "per_rank_img_per_sec": [round(r, 1) for r in per_rank],
                             **throughput_fields(spec, sum(per_rank)),
                             **wait, "step_path": path.name, "step_fallback": path.fallback,
                             "compiled": bool(args.compile),
                             "cuda_graph": graph == "1",
                             "shard_optimizer_state": shard,
                             "optimizer_state_bytes": state_bytes,
                             "cuda_graph_steps": dict(getattr(graphed, "counts", {})),
                             "cuda_graph_fallback": getattr(graphed, "fallback", None),
                             "step_ms": round(1000 * batch * len(per_rank) / sum(per_rank), 2),
                             "train_function_host_ms": host_ms,
                             "train_function_device_ms": device_ms})
                progress(f"{name}: {rows[-1]['rate']:.0f} {spec.unit}, step {path.name} (first "
                         f"step {wait['first_step_s']} s, steady after {wait['warmup_s']} s); in "
                         f"the train function {host_ms} ms host, {device_ms} ms device per step")
                if recorder == "on" and len(recorders) > 1:
                    trace = timeline.write(
                        f"{os.path.splitext(args.result)[0]}.timeline-{mode}.json", runtime.state)
                    rows[-1].update(efficiency_report=text, timeline=trace)
                    for line in (text or "(no efficiency report)").splitlines():
                        progress(line)
                if args.profile:
                    progress(f"{name}: profile, every step waited for")
                    rows[-1].update(profiled(mode, timing))
                    model.train_function = step_timer.wrap(graphed)
                    progress(f"{name}: profile " + "; ".join(
                        f"rank {r}: " + ", ".join(f"{k} {v}" for k, v in p.items())
                        for r, p in enumerate(rows[-1]["per_rank_profile"])))
    if mgpu.is_chief():
        folders.replace_file(args.result, json.dumps(
            {"rows": rows, "versions": versions(keras), "device": device_name(keras)}).encode())


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
