"""``mgpu.init()`` and ``mgpu.shutdown()``: the one place that puts the layers together.

Joining a job takes three layers, in this order, written out here in plain code (the shape of
``jax.distributed.initialize``), not registered as hooks at import time:

1. the runtime (``mgpu_launch.runtime.init``): the placement, MPI, the job key, the process
   sets, the stall inspector and the timeline;
2. on a multi-process job, the Keras backend's engine (``backends.get_engine().setup``): its own
   communicator (TF collective ops with NCCL on GPUs, ``jax.distributed``,
   ``torch.distributed``), unless ``MGPU_ENGINE=none``;
3. the Keras patches, installed once as one context (``training.patches.install``): those
   every backend shares, the engine's patch set, synchronized BatchNormalization, and the
   Keras 2 names a Horovod namespace asks for.

``shutdown()`` undoes them in reverse. Importing this module imports no framework and no Keras:
``import mgpu_launch`` stays light for scripts that use the host collectives only.
"""

import atexit
import sys
from typing import Sequence

from mgpu_launch import backends, runtime
from mgpu_launch.config import settings

__all__ = ["init", "shutdown"]


def init(process_sets=None, *, keras_2: Sequence[str] = ()) -> None:
    """Join the job: the runtime, then the backend's engine, then the Keras patches.

    Idempotent: a second call only checks its `process_sets` against the first's. Call it at
    the top of the script, before building the model: TensorFlow's collectives can only be
    enabled before TensorFlow creates a tensor.

    Args:
        process_sets: as for ``mgpu_launch.runtime.init`` (None, a list of ``ProcessSet``,
            or ``"dynamic"``).
        keras_2: Keras 2 patches a Horovod namespace's init() wants too
            (``training.patches.KERAS_2``).

    Raises:
        Whatever ``mgpu_launch.runtime.init`` raises (a bad ``MGPU_*`` setting, launcher
        variables that disagree with MPI, bad process sets), and the engine's set-up errors.

    Example:
        >>> import mgpu_launch as mgpu
        >>> mgpu.init()
        >>> mgpu.size() >= 1
        True
    """
    if runtime.is_initialized():
        runtime.init(process_sets)  # checks the sets only
        if keras_2:  # a Horovod namespace's init() after mgpu.init(): its Keras 2 names
            from mgpu_launch.training import patches
            patches.install(keras_2, models=False)
        return
    runtime.init(process_sets)
    atexit.register(shutdown)  # runs before the runtime's own (atexit runs last in, first out)
    state = runtime.state
    engine_wanted = settings.choice("MGPU_ENGINE") != "none"
    if state.size > 1 and engine_wanted:
        backends.get_engine().setup(state)
    _install_patches(state.size, engine_wanted, keras_2)


def _install_patches(size: int, engine_wanted: bool, keras_2: Sequence[str]) -> None:
    """The one patch context (``training.patches.install``). On one process only if Keras is
    loaded already: importing it here would slow down every script that uses only the host
    collectives (its first DistributedOptimizer installs the context then); none of the model
    patches with ``MGPU_ENGINE=none``."""
    models = engine_wanted and (size > 1 or "keras" in sys.modules)
    if not (models or keras_2):
        return
    from mgpu_launch.training import patches
    patches.install(keras_2, models=models)


def shutdown() -> None:
    """Leave the job (runs at exit by itself): the engine first, then the runtime. Idempotent;
    ``init()`` may be called again."""
    if runtime.is_initialized():
        backends.reset()
    runtime.shutdown()
