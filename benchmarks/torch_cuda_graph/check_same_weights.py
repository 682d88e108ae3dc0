"""GPU check: 20 steps with the train step captured in a CUDA graph give eager's weights.

    KERAS_BACKEND=torch mgpu-train -np 2 benchmarks/torch_cuda_graph/check_same_weights.py OUT.json

A small CNN with BatchNorm (moving statistics updated inside the graph), SGD with momentum
0.9, the accuracy metric, and LearningRateWarmupCallback with momentum correction (the rate
changes every batch, so a graph that kept the first rate would drift at once). 4 epochs of 4
full batches and one partial one: 20 steps, two batch shapes, each captured after
MGPU_TORCH_CUDA_GRAPH_WARMUP=2 eager steps of its own (the partial shape in epoch 3, replayed
in epoch 4). cudnn.deterministic, no benchmark mode.

Runs, all from the same initial weights and batches:
  eager          MGPU_TORCH_CUDA_GRAPH=0: Keras's own step
  eager-device   MGPU_TORCH_CUDA_GRAPH=1 with a warm-up longer than the run: the same eager
                 step as under capture (learning rate as a device tensor), never captured
  captured       MGPU_TORCH_CUDA_GRAPH=1, warm-up 2
  host-metric    captured, plus a metric that reads its value on the host: must fall back
                 with the warning naming that, and still train like eager-device
Rank 0 writes the maximum relative differences, the counts of eager / captured / replayed
steps, and the warnings to OUT.json; the exit status is 1 when captured and eager-device
differ beyond rtol 1e-5 or the capture did not happen.
"""

import json
import os
import sys
import warnings

import numpy as np

import mgpu_launch as mgpu

STEPS_PER_EPOCH, EPOCHS, BATCH = 5, 4, 32


def main(out_path: str) -> int:
    mgpu.init()
    import keras
    import torch

    from mgpu_launch.backends.torch.graph import CudaGraphFallbackWarning

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    samples = (STEPS_PER_EPOCH - 1) * BATCH + BATCH // 2
    rng = np.random.default_rng(100 + mgpu.rank())
    x = rng.random((samples, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, (samples,)).astype("int32")

    class HostReadingMean(keras.metrics.Metric):
        def __init__(self):
            super().__init__(name="host_mean")
            self.total = self.add_variable((), initializer="zeros", name="total")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.total.assign(float(keras.ops.mean(y_pred)))  # a host read

        def result(self):
            return self.total

    def run(graph: str, warmup: str, host_metric: bool = False):
        os.environ["MGPU_TORCH_CUDA_GRAPH"], os.environ["MGPU_TORCH_CUDA_GRAPH_WARMUP"] = \
            graph, warmup
        keras.utils.set_random_seed(7)
        layers = keras.layers
        model = keras.Sequential([
            keras.Input((32, 32, 3)),
            layers.Conv2D(16, 3, padding="same", use_bias=False), layers.BatchNormalization(),
            layers.ReLU(),
            layers.Conv2D(32, 3, strides=2, padding="same", use_bias=False),
            layers.BatchNormalization(), layers.ReLU(),
            layers.GlobalAveragePooling2D(), layers.Dense(10)])
        metrics = ["accuracy"] + ([HostReadingMean()] if host_metric else [])
        model.compile(optimizer=mgpu.DistributedOptimizer(
            keras.optimizers.SGD(mgpu.scale_lr(0.05), momentum=0.9)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=metrics)
        callbacks = [mgpu.callbacks.LearningRateWarmupCallback(
            mgpu.scale_lr(0.05), warmup_epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH)]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                                verbose=0, callbacks=callbacks)
        ours = [str(w.message) for w in seen if issubclass(w.category, CudaGraphFallbackWarning)]
        counts = dict(getattr(model.train_function, "counts", {}))
        counts["sync_sites"] = list(getattr(model.train_function, "sync_sites", []))
        weights = [np.array(w.numpy(), dtype=np.float64) for w in model.weights]
        trainable = float(sum(np.sum(w.numpy()) for w in model.trainable_weights))
        return weights, history.history, counts, ours, trainable

    runs = {"eager": run("0", "2"), "eager-device": run("1", "1000"),
            "captured": run("1", "2"), "host-metric": run("1", "2", host_metric=True)}

    def max_relative(a, b):
        return max(float(np.max(np.abs(p - q)) / max(np.max(np.abs(q)), 1e-30))
                   for p, q in zip(a, b))

    def allclose(a, b):
        return all(np.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(a, b))

    weights = {name: r[0] for name, r in runs.items()}
    result = {
        "gpus": mgpu.size(), "steps": STEPS_PER_EPOCH * EPOCHS,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "keras": keras.__version__,
        "cudnn_deterministic": True,
        "counts": {name: r[2] for name, r in runs.items()},
        "warnings": {name: r[3] for name, r in runs.items()},
        "history": {name: r[1] for name, r in runs.items()},
        "max_relative_difference": {
            "captured_vs_eager_device": max_relative(weights["captured"], weights["eager-device"]),
            "captured_vs_eager": max_relative(weights["captured"], weights["eager"]),
            "eager_device_vs_eager": max_relative(weights["eager-device"], weights["eager"]),
            "host_metric_vs_eager_device": max_relative(weights["host-metric"],
                                                        weights["eager-device"]),
        },
        "allclose_rtol_1e-5": {
            "captured_vs_eager_device": allclose(weights["captured"], weights["eager-device"]),
            "captured_vs_eager": allclose(weights["captured"], weights["eager"]),
        },
        # trainable weights only: BatchNorm statistics stay local to each rank (Horovod's)
        "ranks_agree": len(set(mgpu.allgather_object(runs["captured"][4]))) == 1,
    }
    ok = (result["allclose_rtol_1e-5"]["captured_vs_eager_device"]
          and runs["captured"][2].get("captured", 0) == 2
          and runs["captured"][2].get("replayed", 0) > 0 and result["ranks_agree"])
    result["ok"] = bool(ok)
    if mgpu.is_chief():
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({k: result[k] for k in ("counts", "warnings", "max_relative_difference",
                                                 "allclose_rtol_1e-5", "ranks_agree", "ok")},
                         indent=1), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
