"""mgpu-launch: Horovod-style multi-process data-parallel training for Keras 3.

    import mgpu_launch as mgpu
    mgpu.init()
    ...

Start the script with ``mgpu-train -np 4 train.py`` (or ``mpirun -np 4 mgpu-train train.py``).
"""

from mgpu_launch.config import __version__

# Every name loads on first use: `import mgpu_launch` imports no framework, no Keras, not even
# numpy, so the launcher (which imports mgpu_launch.config) starts in a fraction of a second.
# init() joins the runtime, sets up the backend's engine and installs the Keras patches, in
# that order, in plain code (training/bootstrap.py).
_LAZY = {
    **dict.fromkeys(("NotInitializedError", "cross_rank", "cross_size", "is_chief",
                     "is_initialized", "local_rank", "local_size", "rank", "size"),
                    "mgpu_launch.runtime"),
    **dict.fromkeys(("Average", "Max", "Min", "MismatchError", "ReduceOp", "Sum", "allgather",
                     "allgather_object", "allreduce", "barrier", "broadcast",
                     "broadcast_object"), "mgpu_launch.runtime.collectives"),
    **dict.fromkeys(("NotInProcessSetError", "ProcessSet", "add_process_set",
                     "global_process_set", "remove_process_set"),
                    "mgpu_launch.runtime.process_sets"),
    "init": "mgpu_launch.training.bootstrap", "shutdown": "mgpu_launch.training.bootstrap",
    "DistributedOptimizer": "mgpu_launch.training.optimizer",
    "scale_lr": "mgpu_launch.training.optimizer", "load_model": "mgpu_launch.training.saving",
    "Compression": "mgpu_launch.backends.compression",
    "callbacks": "mgpu_launch.callbacks", "data": "mgpu_launch.data",
    "layers": "mgpu_launch.layers",
    "run": "mgpu_launcher.python_api", "RemoteError": "mgpu_launcher.python_api",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module = importlib.import_module(_LAZY[name])
        return module if name in ("callbacks", "data", "layers") else getattr(module, name)
    raise AttributeError(f"module 'mgpu_launch' has no attribute {name!r}")


__all__ = [
    "__version__", "init", "shutdown", "is_initialized", "size", "rank", "local_rank",
    "local_size", "cross_rank", "cross_size", "is_chief", "allreduce", "allgather",
    "allgather_object", "broadcast", "broadcast_object", "barrier", "ReduceOp", "Average",
    "Sum", "Min", "Max", "MismatchError", "NotInitializedError", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "NotInProcessSetError",
    "DistributedOptimizer",
    "scale_lr", "load_model", "Compression", "callbacks", "data", "layers", "run",
    "RemoteError",
]
