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

if os.environ.get("TFX_LAG_LOGS") == "1":
    # Keras reads the logs at every batch end on TensorFlow (no asynchronous callbacks there), so
    # the host waits for step k before it calls step k+1 and the GPU idles while the next call
    # is prepared. Returning step k-1's logs from step k's call lets step k run while the host
    # waits for k-1 and prepares k+1: the per-batch logs lag one step (the epoch's are read from
    # the metrics, unchanged). Measured before it becomes an mgpu setting.
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer as _Trainer

    _make = _Trainer.make_train_function

    def _make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        _make(self, force)  # sets self.train_function (returns nothing on TensorFlow)
        function = self.train_function
        pending = []

        def lagged(iterator):
            pending.append(function(iterator))
            return pending.pop(0) if len(pending) > 1 else pending[0]

        self.train_function = lagged
        return lagged

    _Trainer.make_train_function = _make_train_function
    print("[tfx] train logs lag one step", flush=True)
