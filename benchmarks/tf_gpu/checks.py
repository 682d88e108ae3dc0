"""TensorFlow-on-GPU arithmetic checks (issue 24): is the carried CUDA 12 library set right?

A wrong set (cuBLAS or cudart 13 symlinked as 12) trained digits to 11% silently, so this runs
before anything else on the GPU machine. TF32 is off (NVIDIA_TF32_OVERRIDE=0 and TF's own
switch): float32 arithmetic must land near 1e-6 of a float64 reference.

    python benchmarks/tf_gpu/checks.py OUT.json
Exit status 1 when a check fails.
"""

import json
import sys

import numpy as np
import tensorflow as tf

tf.config.experimental.enable_tensor_float_32_execution(False)
gpus = tf.config.list_physical_devices("GPU")
rng = np.random.default_rng(0)


def relative(out, ref) -> float:
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))


a = rng.standard_normal((1024, 1024)).astype(np.float32)
b = rng.standard_normal((1024, 1024)).astype(np.float32)
ref = a.astype(np.float64) @ b.astype(np.float64)
with tf.device("/GPU:0"):
    eager = tf.matmul(a, b).numpy()
    xla = tf.function(lambda x, y: tf.matmul(x, y), jit_compile=True)(a, b).numpy()
image = rng.standard_normal((8, 32, 32, 16)).astype(np.float32)
kernel = rng.standard_normal((3, 3, 16, 32)).astype(np.float32)
with tf.device("/CPU:0"):
    conv_cpu = tf.nn.conv2d(image, kernel, 1, "SAME").numpy()
with tf.device("/GPU:0"):
    conv_gpu = tf.nn.conv2d(image, kernel, 1, "SAME").numpy()
result = {
    "gpus": [g.name for g in gpus],
    "tensorflow": tf.__version__,
    "cuda_build": tf.sysconfig.get_build_info().get("cuda_version"),
    "cudnn_build": tf.sysconfig.get_build_info().get("cudnn_version"),
    "matmul_eager_vs_float64": relative(eager, ref),
    "matmul_xla_vs_float64": relative(xla, ref),
    "conv_gpu_vs_cpu": relative(conv_gpu, conv_cpu.astype(np.float64)),
}
result["ok"] = bool(gpus) and all(result[k] < 1e-5 for k in (
    "matmul_eager_vs_float64", "matmul_xla_vs_float64", "conv_gpu_vs_cpu"))
print(json.dumps(result, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
sys.exit(0 if result["ok"] else 1)
