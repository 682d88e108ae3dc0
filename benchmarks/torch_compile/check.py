"""Keras-torch GPT-2 under mgpu: the compiled step (backends/torch/compiled.py) against eager.

    KERAS_BACKEND=torch python benchmarks/torch_compile/check.py --size tiny          # CPU is fine
    KERAS_BACKEND=torch python benchmarks/torch_compile/check.py --size small --precision mixed_bfloat16
    KERAS_BACKEND=torch python benchmarks/torch_compile/check.py --json out.json      # also a file

For each path (eager: jit_compile=False; compiled: jit_compile=True), one process, a fresh model
with the same initial weights, a DistributedOptimizer(AdamW), the same batches of token ids
already on the device: the first step's seconds (the compiled path's includes tracing and
compiling), steps/s over the timed steps, tokens/s; for the compiled path also the traces, the
dynamo graphs, graph breaks and recompiles. Then both paths again for 5 steps from the same
weights: the largest |difference| of any weight, beside the largest |weight| (Adam's epsilon is
1e-3 there: with Keras's 1e-7, a weight whose gradient is zero in exact arithmetic, such as an
attention key bias, moves by rounding noise amplified 1e4 times on both paths).
Nothing here is a figure until it has been run; docs/torch-compile.md says where and when.
"""

import argparse
import json
import os
import platform
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import mgpu_launch as mgpu  # noqa: E402

SIZES = {  # (layers, heads, hidden, feed-forward, vocabulary), as examples/keras_hub_causal_lm.py
    "tiny": (2, 2, 64, 256, 512),
    "small": (6, 8, 512, 2048, 8192),
}


def build(size: str, seq_len: int):
    import keras
    import keras_hub
    layers, heads, hidden, feed_forward, vocabulary = SIZES[size]
    keras.utils.set_random_seed(42)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary, num_layers=layers, num_heads=heads, hidden_dim=hidden,
        intermediate_dim=feed_forward, dropout=0.0, max_sequence_length=seq_len)
    return keras.Model(backbone.input, backbone.token_embedding(backbone.output, reverse=True))


def batches(size: str, seq_len: int, batch: int, count: int):
    """`count` batches ((token_ids, padding_mask), next tokens) as device tensors."""
    import torch
    from mgpu_launch.keras_internals import torch_device as get_device
    vocabulary = SIZES[size][4]
    rng = np.random.default_rng(0)
    ids = torch.as_tensor(rng.integers(1, vocabulary, size=(count, batch, seq_len + 1)),
                          dtype=torch.int32, device=get_device())
    mask = torch.ones((batch, seq_len), dtype=torch.bool, device=ids.device)
    return [({"token_ids": ids[i, :, :-1], "padding_mask": mask}, ids[i, :, 1:])
            for i in range(count)]


def run(args, jit_compile: bool, steps: int, initial=None):
    """(figures, weights after `steps` steps) of one path."""
    import keras
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = build(args.size, args.seq_len)
    if initial is not None:
        model.set_weights(initial)
    model.compile(optimizer=mgpu.DistributedOptimizer(keras.optimizers.AdamW(1e-4, epsilon=1e-3)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    data = batches(args.size, args.seq_len, args.batch_size, steps)
    model.make_train_function()
    step = model.train_function
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for batch in data:
        started = time.perf_counter()
        logs = step([batch])
        float(logs["loss"])  # waits for the step
        sync()
        times.append(time.perf_counter() - started)
    # the compiled path's second step traces and compiles: never among the timed ones
    warm = max(2 if jit_compile else 1, min(args.warmup, steps - 1))
    timed = sum(times[warm:])
    figures = {
        "path": "compiled" if jit_compile else "eager",
        "first_step_s": round(times[0] + (times[1] if jit_compile else 0.0), 3),
        "steps_per_s": round((steps - warm) / timed, 3) if timed else None,
        "tokens_per_s": round((steps - warm) * args.batch_size * args.seq_len / timed)
        if timed else None,
        "loss": float(logs["loss"]),
    }
    if jit_compile:
        figures.update(counts=dict(getattr(step, "counts", {})),
                       fallback=getattr(step, "fallback", "not mgpu's compiled step"),
                       graphs=counters["stats"].get("unique_graphs", 0),
                       graph_breaks=sum(counters["graph_break"].values()),
                       recompiles=sum(counters["recompiles"].values()))
    return figures, [np.asarray(w) for w in model.get_weights()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="timed run: steps per path")
    parser.add_argument("--warmup", type=int, default=5,
                        help="steps left out of steps/s (at least the first two when compiled)")
    parser.add_argument("--precision", default="float32",
                        choices=["float32", "mixed_bfloat16"])
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    mgpu.init()
    import keras
    import torch
    keras.mixed_precision.set_global_policy(args.precision)
    if torch.cuda.is_available():  # the comparison wants the same float32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results = {"size": args.size, "seq_len": args.seq_len, "batch_size": args.batch_size,
               "precision": args.precision, "torch": torch.__version__,
               "keras": keras.__version__, "machine": platform.node(),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for jit_compile in (False, True):
        figures, _ = run(args, jit_compile, args.steps)
        results[figures["path"]] = figures
        print(json.dumps(figures), flush=True)
    initial = [np.asarray(w) for w in build(args.size, args.seq_len).get_weights()]
    _, eager = run(args, False, 5, initial)
    _, ours = run(args, True, 5, initial)
    results["max_weight_difference_after_5_steps"] = max(
        float(np.max(np.abs(a - b))) for a, b in zip(ours, eager))
    results["max_weight"] = max(float(np.max(np.abs(b))) for b in eager)
    results["speedup"] = (round(results["compiled"]["steps_per_s"]
                                / results["eager"]["steps_per_s"], 2)
                          if results["eager"]["steps_per_s"] else None)
    print(json.dumps({k: v for k, v in results.items() if k not in ("eager", "compiled")}))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
