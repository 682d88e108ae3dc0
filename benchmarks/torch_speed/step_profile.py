"""Where a Keras-torch ResNet-50 step's GPU time goes, against torchvision's, on one GPU.

    python benchmarks/torch_speed/step_profile.py --precision mixed_bfloat16 \\
        --variant keras:kernels=0:graph=0 --variant keras:kernels=1:graph=1 --variant native

Each ``--variant`` runs in its own process (patches are per process): ``keras`` is
keras.applications.ResNet50 compiled with mgpu's DistributedOptimizer (SGD momentum 0.9, one
process), trained by ``train_on_batch`` on one device-resident batch; ``kernels`` is
MGPU_TORCH_KERNELS, ``graph`` is MGPU_TORCH_CUDA_GRAPH; ``eagerfirst=1`` runs 5 eager steps of
the same model before turning capture on (the fall-back issue 54 saw). ``native`` is
torchvision's ResNet-50 in channels_last memory with autocast (mgpu-bench's native row).
Per variant: ms per step (median of 5 windows of 5 steps, each ended by a device sync),
img/s, then torch.profiler over 3 steps: the kernels by total CUDA time (top 15) and the
CUDA time per step by kernel family.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

FAMILIES = [  # (family, pattern over the kernel's name), first match wins
    ("batch norm (cudnn/native)", r"batch_?norm|bn_fw|bn_bw|BatchNorm|welford"),
    ("convolution / GEMM", r"conv|gemm|sm90|cutlass|xmma|implicit|wgrad|dgrad|fprop|cudnn"),
    ("reduction", r"reduce_kernel|Reduce"),
    ("copy / cast", r"copy|Memcpy|cast|CatArray"),
    ("elementwise", r"elementwise|vectorized|foreach|multi_tensor|unrolled"),
    ("pooling", r"pool"),
    ("nccl", r"nccl"),
]


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def parse(variant: str) -> dict:
    kind, *options = variant.split(":")
    spec = {"kind": kind, "kernels": "1", "graph": "0", "eagerfirst": "0"}
    spec.update(option.split("=", 1) for option in options)
    return spec


def keras_step(spec, args):
    os.environ["MGPU_TORCH_KERNELS"] = spec["kernels"]
    os.environ["MGPU_TORCH_CUDA_GRAPH"] = "0" if spec["eagerfirst"] == "1" else spec["graph"]
    import keras
    import torch

    import mgpu_launch as mgpu

    mgpu.init()
    keras.config.set_dtype_policy(args.precision)
    model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    optimizer = mgpu.DistributedOptimizer(keras.optimizers.SGD(0.0125, momentum=0.9))
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    images = torch.randn(args.batch, 224, 224, 3, device=args.device)
    labels = torch.randint(0, 1000, (args.batch,), device=args.device)
    notes = []
    if spec["eagerfirst"] == "1":
        for _ in range(5):
            model.train_on_batch(images, labels)
        os.environ["MGPU_TORCH_CUDA_GRAPH"] = spec["graph"]
        model.make_train_function(force=True)
        notes.append("5 eager steps, then make_train_function(force=True) with capture on")
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")

        def step():
            model.train_on_batch(images, labels)
        result = measure(step, args)
    notes += [f"{w.category.__name__}: {w.message}" for w in seen
              if "Graph" in w.category.__name__]
    counts = getattr(model.train_function, "counts", None)
    if counts is not None:
        notes.append(f"graph step counts: {dict(counts)}")
    return result, notes


def native_step(spec, args):
    import torch
    import torchvision

    model = torchvision.models.resnet50().to(args.device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0125, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    images = torch.randn(args.batch, 3, 224, 224, device=args.device).to(
        memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), device=args.device)
    half = {"mixed_bfloat16": torch.bfloat16}.get(args.precision)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=half or torch.float32, enabled=half is not None):
            loss = loss_fn(model(images), labels)
        loss.backward()
        optimizer.step()
    return measure(step, args), []


def measure(step, args) -> dict:
    import torch

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    windows = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(5):
            step()
        sync()
        windows.append((time.perf_counter() - start) / 5)
    ms = statistics.median(windows) * 1000
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        sync()
    kernels = {}
    for event in prof.events():
        if event.device_type.name == "CUDA" or args.device == "cpu":
            entry = kernels.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time_total if hasattr(event, "device_time_total") \
                else event.cuda_time_total
    total = sum(us for _, us in kernels.values())
    families = {}
    for name, (_, us) in kernels.items():
        families[family(name)] = families.get(family(name), 0.0) + us
    top = sorted(kernels.items(), key=lambda item: -item[1][1])[:15]
    return {"ms_per_step": round(ms, 2), "img_per_sec": round(args.batch / ms * 1000, 1),
            "cuda_ms_per_step": round(total / 3 / 1000, 2),
            "families_ms_per_step": {k: round(v / 3 / 1000, 2)
                                     for k, v in sorted(families.items(), key=lambda i: -i[1])},
            "top_kernels": [{"name": name[:110], "calls_per_step": round(n / 3, 1),
                             "ms_per_step": round(us / 3 / 1000, 2)}
                            for name, (n, us) in top]}


def child(args) -> None:
    spec = parse(args.child)
    result, notes = (native_step if spec["kind"] == "native" else keras_step)(spec, args)
    print("RESULT " + json.dumps({"variant": args.child, "precision": args.precision,
                                  "batch": args.batch, **result, "notes": notes}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--out", default=None, help="append each result as a JSON line here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    for variant in args.variant:
        command = [sys.executable, __file__, "--child", variant, "--precision", args.precision,
                   "--batch", str(args.batch), "--warmup", str(args.warmup),
                   "--device", args.device]
        started = time.time()
        run = subprocess.run(command, capture_output=True, text=True, timeout=400)
        lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
        if run.returncode or not lines:
            print(f"== {variant} {args.precision}: FAILED rc={run.returncode}\n"
                  f"{run.stderr[-3000:]}", flush=True)
            continue
        result = json.loads(lines[-1][7:])
        result["wall_s"] = round(time.time() - started, 1)
        print(f"== {variant} {args.precision} batch {args.batch}: {result['ms_per_step']} ms/step"
              f" = {result['img_per_sec']} img/s; CUDA {result['cuda_ms_per_step']} ms/step "
              f"({result['wall_s']} s)", flush=True)
        print("   families: " + ", ".join(f"{k} {v}" for k, v in
                                          result["families_ms_per_step"].items()), flush=True)
        for kernel in result["top_kernels"]:
            print(f"   {kernel['ms_per_step']:8.2f} ms {kernel['calls_per_step']:7.1f}x  "
                  f"{kernel['name']}", flush=True)
        for note in result["notes"]:
            print(f"   note: {note}", flush=True)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
