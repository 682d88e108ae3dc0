"""Full float32 and deterministic GPU kernels for the test workers' exactness comparisons.

On Ampere/Hopper GPUs TensorFlow, JAX and torch multiply in TF32 by default (~1e-3 relative
differences between the ranks' and the reference's sums), ``NVIDIA_TF32_OVERRIDE=0`` reaches
cuBLAS only (not XLA's own GEMMs), and XLA's GPU scatter-add and some reductions use atomics,
so two ranks adding the same numbers in another order differ in the last bit
(benchmarks/multi_gpu/README.md). A worker calls :func:`apply_if_asked` right after importing
Keras; it acts when ``EXACTNESS_FP32=1`` or ``NVIDIA_TF32_OVERRIDE=0`` is set (the GPU sessions'
scripts set them), and does nothing on the CPU runs of CI.
"""

import os


def asked() -> bool:
    return os.environ.get("EXACTNESS_FP32") == "1" or os.environ.get("NVIDIA_TF32_OVERRIDE") == "0"


def full_float32(backend: str) -> None:
    """TF32 off, and deterministic kernels where the framework offers them, for `backend`."""
    if backend == "tensorflow":
        import tensorflow as tf
        tf.config.experimental.enable_tensor_float_32_execution(False)
        tf.config.experimental.enable_op_determinism()
    elif backend == "jax":
        import jax
        jax.config.update("jax_default_matmul_precision", "highest")
    elif backend == "torch":
        import torch
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True


def apply_if_asked(backend: str) -> None:
    if asked():
        full_float32(backend)
