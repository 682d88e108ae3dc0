"""mgpu-launch: Horovod-style multi-process data-parallel training for Keras 3.

    import mgpu_launch as mgpu
    mgpu.init()
    ...

Start the script with ``mgpu-train -np 4 train.py`` (or ``mpirun -np 4 mgpu-train train.py``).
"""

from mgpu_launcher import __version__
from mgpu_launch.collectives import (Average, Max, Min, MismatchError, ReduceOp, Sum,
                                     allgather, allgather_object, allreduce, barrier, broadcast,
                                     broadcast_object)
from mgpu_launch.runtime import (NotInitializedError, cross_rank, cross_size, init,
                                 is_chief, is_initialized, local_rank, local_size, rank,
                                 shutdown, size)

# Importing the engine package (no framework yet) adds its set-up to init() and shutdown().
from mgpu_launch import engines as _engines  # noqa: E402,F401  isort: skip

# The Keras-facing parts import keras (and with it the backend); load them on first use so
# that `import mgpu_launch` and the host collectives stay light.
_LAZY = {
    "DistributedOptimizer": "mgpu_launch.optimizer", "scale_lr": "mgpu_launch.optimizer",
    "load_model": "mgpu_launch.optimizer", "Compression": "mgpu_launch.compression",
    "callbacks": "mgpu_launch.callbacks", "data": "mgpu_launch.data",
    "run": "mgpu_launch.launch", "RemoteError": "mgpu_launch.launch",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module = importlib.import_module(_LAZY[name])
        return module if name in ("callbacks", "data") else getattr(module, name)
    raise AttributeError(f"module 'mgpu_launch' has no attribute {name!r}")


__all__ = [
    "__version__", "init", "shutdown", "is_initialized", "size", "rank", "local_rank",
    "local_size", "cross_rank", "cross_size", "is_chief", "allreduce", "allgather",
    "allgather_object", "broadcast", "broadcast_object", "barrier", "ReduceOp", "Average",
    "Sum", "Min", "Max", "MismatchError", "NotInitializedError", "DistributedOptimizer",
    "scale_lr", "load_model", "Compression", "callbacks", "data", "run", "RemoteError",
]
