"""Experiment hooks for benchmarks/tf_gpu/scaling.sh (issue 38), loaded only when this folder
is first on PYTHONPATH. TFX_BARRIER=1: an XLA optimization barrier around the fused gradient
buffer before and after the engine's collective, so XLA cannot split, move or fold the one
all-reduce into the backward pass."""
import os

if os.environ.get("TFX_BARRIER") == "1":
    from mgpu_launch.backends.tensorflow import collectives as _collectives, engine as _engine

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

if os.environ.get("TFX_HOSTPROF"):
    # Where the host waits inside Keras's train function (issue 38): every call is timed, and
    # the time spent getting the batch (next() on the iterator) apart from the compiled step's
    # call; calls TFX_PROF_START .. +TFX_PROF_COUNT run under TensorFlow's profiler (host,
    # python and CUDA API tracers), converted to a Chrome trace beside the xplane, for
    # benchmarks/tf_gpu/trace_summary.py. A rank prints its medians when it exits.
    import atexit
    import gzip
    import statistics
    import time

    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer as _Trainer

    _make_function = _Trainer.make_train_function
    _rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    _size = os.environ.get("OMPI_COMM_WORLD_SIZE", "1")
    _start = int(os.environ.get("TFX_PROF_START", "15"))
    _count = int(os.environ.get("TFX_PROF_COUNT", "10"))
    _calls, _nexts = [], []

    class _TimedIterator:
        def __init__(self, iterator):
            self.iterator = iterator
            self.first = None

        def peek(self):  # the first batch, kept for the first next()
            self.first = next(self.iterator)
            return self.first

        def __iter__(self):
            return self

        def __next__(self):
            if self.first is not None:
                batch, self.first = self.first, None
                return batch
            begin = time.perf_counter()
            try:
                return next(self.iterator)
            finally:
                _nexts[-1] += time.perf_counter() - begin

    def _profile(on):
        import tensorflow as tf
        logdir = os.path.join(os.environ["TFX_HOSTPROF"], f"rank{_rank}of{_size}")
        if on:
            options = tf.profiler.experimental.ProfilerOptions(
                host_tracer_level=3, python_tracer_level=1, device_tracer_level=1)
            tf.profiler.experimental.start(logdir, options=options)
            return
        tf.profiler.experimental.stop()
        from tensorflow.python.profiler.internal import _pywrap_profiler_plugin as plugin
        for root, _, files in os.walk(logdir):
            for name in files:
                if name.endswith(".xplane.pb"):
                    data, ok = plugin.xspace_to_tools_data([os.path.join(root, name)],
                                                           "trace_viewer@")
                    if ok:
                        with gzip.open(os.path.join(logdir, "trace.json.gz"), "wb") as out:
                            out.write(data if isinstance(data, bytes) else data.encode())
        print(f"[tfx] rank {_rank}: profile of calls {_start}-{_start + _count - 1} in "
              f"{logdir}", flush=True)

    def _where(batch):  # where each input of the step lives (an int32 stays in host memory)
        import tensorflow as tf
        for tensor in tf.nest.flatten(batch):
            print(f"[tfx] rank {_rank}: step input {tensor.dtype.name} {tuple(tensor.shape)} "
                  f"on {getattr(tensor, 'device', '?')}, backed by "
                  f"{getattr(tensor, 'backing_device', '?')}", flush=True)

    def _make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        _make_function(self, force)
        function = self.train_function

        def timed(iterator):
            if len(_calls) == _start:
                _profile(True)
            _nexts.append(0.0)
            begin = time.perf_counter()
            if not type(iterator).__module__.startswith("tensorflow"):
                iterator = _TimedIterator(iterator)
            if not _calls:
                print(f"[tfx] rank {_rank}: the train function is fed a "
                      f"{type(getattr(iterator, 'iterator', iterator)).__name__}", flush=True)
                if hasattr(iterator, "peek"):
                    _where(iterator.peek())
            logs = function(iterator)
            _calls.append(time.perf_counter() - begin)
            if len(_calls) == _start + _count:
                _profile(False)
            return logs

        self.train_function = timed
        return timed

    _Trainer.make_train_function = _make_train_function

    @atexit.register
    def _report():
        if len(_calls) > 5:
            calls, nexts = _calls[5:], _nexts[5:len(_calls)]
            print(f"[tfx] rank {_rank}: {len(calls)} calls of the train function: median "
                  f"{statistics.median(calls) * 1e3:.2f} ms, of which next() "
                  f"{statistics.median(nexts) * 1e3:.2f} ms; the compiled step's call "
                  f"{statistics.median(c - n for c, n in zip(calls, nexts)) * 1e3:.2f} ms",
                  flush=True)
    print("[tfx] train function timed, profiler on calls "
          f"{_start}-{_start + _count - 1}", flush=True)

if os.environ.get("TFX_ASYNC") == "1":
    # Research note E9: TensorFlow's asynchronous eager executor (errors surface late).
    import tensorflow as _tf
    _tf.config.experimental.set_synchronous_execution(False)
    print("[tfx] asynchronous eager execution", flush=True)
