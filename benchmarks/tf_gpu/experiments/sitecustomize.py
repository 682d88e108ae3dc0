"""Experiment hooks for benchmarks/tf_gpu/scaling.sh (issue 38), loaded only when this folder
is first on PYTHONPATH. TFX_BARRIER=1: an XLA optimization barrier around the fused gradient
buffer before and after the engine's collective, so XLA cannot split, move or fold the one
all-reduce into the backward pass."""
import os

if os.environ.get("TFX_BARRIER") == "1":
    from mgpu_launch.engines import tensorflow as _engine
    from mgpu_launch.engines import tensorflow_collectives as _collectives

    _original = _engine.TensorFlowEngine._sum_flat

    def _sum_flat(self, flat, group):
        if not _collectives._in_xla():
            return _original(self, flat, group)
        from tensorflow.compiler.tf2xla.python import xla
        (flat,) = xla.optimization_barrier(flat)
        (summed,) = xla.optimization_barrier(_original(self, flat, group))
        return summed

    _engine.TensorFlowEngine._sum_flat = _sum_flat
    print("[tfx] optimization barrier around the gradient collective", flush=True)
