"""Why a torch train step run eagerly first then fails its CUDA-graph capture (issue 54 item 3).

    python benchmarks/torch_speed/eager_then_capture.py [--resnet]

Each variant in its own process, one GPU: a small model compiled with mgpu's
DistributedOptimizer takes EAGER steps (`train_on_batch`, capture off), then capture is turned
on (MGPU_TORCH_CUDA_GRAPH=1, make_train_function(force=True)) and 8 more steps run. Prints
whether the step was captured and, when not, the capture's full traceback. Variants bisect:
the model (dense only / conv / conv + BatchNormalization), the optimizer (SGD, SGD momentum,
Adam), MGPU_TORCH_KERNELS, and EAGER=0 (capture from the first step: the control).
"""

import json
import os
import subprocess
import sys
import traceback

VARIANTS = [
    {"model": "dense", "optimizer": "sgd", "eager": 0},
    {"model": "dense", "optimizer": "sgd", "eager": 3},
    {"model": "dense", "optimizer": "momentum", "eager": 3},
    {"model": "dense", "optimizer": "adam", "eager": 3},
    {"model": "conv_bn", "optimizer": "momentum", "eager": 3},
    {"model": "conv_bn", "optimizer": "momentum", "eager": 3, "kernels": "0"},
    {"model": "dense", "optimizer": "sgd", "eager": 1},
]
#: ``--resnet``: ResNet-50 in bfloat16 at batch 128, where step_profile.py saw capture fail
RESNET = [{"model": "resnet50", "optimizer": "momentum", "eager": 0},
          {"model": "resnet50", "optimizer": "momentum", "eager": 5},
          {"model": "resnet50", "optimizer": "momentum", "eager": 5, "kernels": "0"}]


def child(spec) -> dict:
    os.environ["MGPU_TORCH_KERNELS"] = spec.get("kernels", "1")
    os.environ["MGPU_TORCH_CUDA_GRAPH"] = "0" if spec["eager"] else "1"
    import keras
    import torch

    import mgpu_launch as mgpu
    from mgpu_launch.backends.torch import graph as torch_graph

    errors = []
    capture = torch_graph.GraphedTrainStep._capture

    def traced_capture(self, data, flat):
        try:
            return capture(self, data, flat)
        except Exception:
            errors.append(traceback.format_exc()[-4000:])
            raise
    torch_graph.GraphedTrainStep._capture = traced_capture

    mgpu.init()
    if spec["model"] == "resnet50":
        keras.config.set_dtype_policy("mixed_bfloat16")
        model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))
        x = torch.randn(128, 224, 224, 3, device="cuda")
        y = torch.randint(0, 1000, (128,), device="cuda")
    elif spec["model"] == "dense":
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10)])
        x = torch.randn(64, 32, device="cuda")
    else:
        model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3),
                                  keras.layers.BatchNormalization(), keras.layers.ReLU(),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        x = torch.randn(64, 16, 16, 3, device="cuda")
    if spec["model"] != "resnet50":
        y = torch.randint(0, 10, (64,), device="cuda")
    inner = {"sgd": lambda: keras.optimizers.SGD(0.01),
             "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
             "adam": lambda: keras.optimizers.Adam(1e-3)}[spec["optimizer"]]()
    model.compile(mgpu.DistributedOptimizer(inner),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(spec["eager"]):
        model.train_on_batch(x, y)
    os.environ["MGPU_TORCH_CUDA_GRAPH"] = "1"
    model.make_train_function(force=True)
    for _ in range(8):
        model.train_on_batch(x, y)
    step = model.train_function
    return {**spec, "counts": dict(getattr(step, "counts", {})),
            "fallback": getattr(step, "fallback", None), "traceback": errors[:1]}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return
    for spec in RESNET if "--resnet" in sys.argv else VARIANTS:
        run = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                             capture_output=True, text=True, timeout=300)
        lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
        if not lines:
            print(f"== {spec}: rc={run.returncode}\n{run.stderr[-2000:]}", flush=True)
            continue
        result = json.loads(lines[-1][7:])
        print(f"== {spec}: counts {result['counts']} fallback {result['fallback']}", flush=True)
        for text in result["traceback"]:
            print(text, flush=True)


if __name__ == "__main__":
    main()
