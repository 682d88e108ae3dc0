"""Keras's per-batch logs one step late, so the host never waits for the step it just queued.

On TensorFlow, Keras dispatches no callback asynchronously (the backend is not marked
thread-safe), so at every batch end its ``CallbackList`` turns the step's logs into Python
numbers: the host waits for step k to finish on the device before it even starts to prepare
step k+1, and the device idles for the whole host time of the next call (on 2 GPUs, ResNet-50
bf16: 17.8 ms of a 37.7 ms step; ``benchmarks/tf_gpu/results_2026-11-26-h200x2-second``).
:class:`LaggedLogs` hands Keras step k-1's logs after it queued step k: Keras then waits for
the step before, while step k runs, and the device has work queued at all times.

What changes for a user: a callback's ``on_train_batch_end(k, logs)`` sees the logs of batch
k-1 (batch 0 its own; the first batch of each new data iterator, ``train_on_batch`` included,
its own); a ``TerminateOnNaN`` stops one batch later. The epoch's logs (History, checkpoints,
``EarlyStopping``) are unchanged: Keras reads them from the metrics. A train step whose logs
are not the model's metrics (a custom ``train_step`` returning other keys) is never lagged, as
Keras would then give its epoch the last batch's logs.
"""

from typing import Any, Callable, List


class LaggedLogs:
    """Keras's train function, returning the previous call's logs for the same iterator.

    Args:
        model: the Keras model (its metrics decide whether the logs may lag at all).
        function: Keras's train function (called with the data iterator, returns logs).

    Example:
        >>> model.train_function = LaggedLogs(model, model.train_function)
        >>> model.train_function(iterator)  # step 0's logs (it waits for step 0)
        >>> model.train_function(iterator)  # step 0's logs again; step 1 runs meanwhile
    """

    def __init__(self, model, function: Callable[[Any], Any]):
        self.model = model
        self.function = function
        self._iterator = None
        self._pending: List[Any] = []
        self._lags = None  # decided at the first call: the logs are the model's metrics

    def __call__(self, iterator):
        logs = self.function(iterator)
        if self._lags is None:
            self._lags = _are_metrics(self.model, logs)
        if not self._lags:
            return logs
        if iterator is not self._iterator:  # a new epoch's data, or train_on_batch
            self._iterator, self._pending = iterator, []
        self._pending.append(logs)
        return self._pending.pop(0) if len(self._pending) > 1 else logs

    def __getattr__(self, name):  # what else callers ask of Keras's function
        return getattr(self.function, name)


def _are_metrics(model, logs) -> bool:
    """Whether `logs` has exactly the keys of the model's metrics (Keras then takes the epoch's
    logs from the metrics, not from the last batch's logs)."""
    try:
        return isinstance(logs, dict) and set(logs) == set(model.get_metrics_result())
    except Exception:  # a metric that cannot report yet: keep Keras's behaviour
        return False
