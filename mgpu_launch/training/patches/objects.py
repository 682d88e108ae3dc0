"""The replacements of what Keras objects accept and save: BatchNormalization, the optimizer.

Private to :mod:`mgpu_launch.training.patches`, which holds the registry (which Keras attribute
each factory here replaces, checked before it is installed) and the table of why. Each factory
takes Keras's original attribute and returns the replacement; none is installed from here.
``synchronized=True`` BatchNormalization on every backend, the compile config a saved model
loads without mgpu_launch, and Keras 2's ``compile`` argument and ``opt.variables()`` for the
Horovod namespaces.
"""

import functools
import inspect
import warnings

from mgpu_launch import backends, runtime
from mgpu_launch.training import optimizer_options


def compile_config(original):
    # Keras names a saved object's class after type(obj): without this, a saved model's
    # optimizer is "DistributedOptimizer", which only loads where mgpu_launch is importable.
    @functools.wraps(original)
    def get_compile_config(self):
        config = original(self)
        optimizer = getattr(self, "optimizer", None)
        if (isinstance(config, dict) and "optimizer" in config and optimizer is not None
                and optimizer_options.distributed_optimizer(self) is optimizer):
            config = dict(config, optimizer=optimizer.inner_config())
        return config
    return get_compile_config


def horovod_compile(original):
    warned = []

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        if "experimental_run_tf_function" in kwargs:
            del kwargs["experimental_run_tf_function"]
            if not warned and runtime.state.rank == 0:
                warned.append(True)
                warnings.warn("compile(experimental_run_tf_function=...) is a Keras 2 argument; "
                              "Keras 3 has no such argument, so mgpu_launch.keras drops it "
                              "(the optimizer runs inside the compiled step anyway). Remove it.",
                              stacklevel=2)
        return original(self, *args, **kwargs)
    return compile


def batch_norm_init(original):
    # the patch registry (patches/__init__.py) checked that `synchronized` is a parameter
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        synchronized = bound.arguments.pop("synchronized", False)
        original(*bound.args, **bound.kwargs)  # Keras raises for it off TensorFlow
        self.synchronized = synchronized
    # Keras's Operation.__new__ reads the signature without following __wrapped__.
    __init__.__signature__ = signature
    return __init__


def batch_norm_moments(original):
    def _moments(self, inputs, mask):
        if not self.synchronized:
            return original(self, inputs, mask)
        from mgpu_launch.training import batch_statistics
        moments = batch_statistics.synchronized_moments(inputs, self._reduction_axes, mask)
        if moments is not None:
            return moments
        import keras
        known = backends.BACKENDS.get(keras.backend.backend())
        if known is not None and known.keras_synchronizes_batch_norm:
            return original(self, inputs, mask)  # Keras's: a tf.distribute strategy's, or local
        self.synchronized = False  # Keras's local statistics (its own raise off TensorFlow)
        try:
            return original(self, inputs, mask)
        finally:
            self.synchronized = True
    return _moments


class _CallableList(list):
    """A list that is also callable, returning itself (Keras 2's ``optimizer.variables()``)."""

    def __call__(self):
        return self


class _VariablesProperty(property):
    """A property that can carry the ``_mgpu`` / ``__wrapped__`` marks ``patches.apply`` sets."""


def optimizer_variables(original):
    return _VariablesProperty(lambda self: _CallableList(original.fget(self)),
                              doc=original.__doc__)
