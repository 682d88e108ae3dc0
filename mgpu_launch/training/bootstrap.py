"""``mgpu.init()`` and ``mgpu.shutdown()``: the one place that puts the layers together.

Joining a job takes three layers, in this order, written out here in plain code (the shape of
``jax.distributed.initialize``), not registered as hooks at import time:

1. the runtime (``mgpu_launch.runtime.init``): the placement, MPI, the job key, the process
   sets, the stall inspector and the timeline;
2. on a multi-process job, the Keras backend's engine (``backends.get_engine().setup``): its own
   communicator (TF collective ops with NCCL on GPUs, ``jax.distributed``,
   ``torch.distributed``), unless ``MGPU_ENGINE=none``;
3. the Keras patches every model needs from the start (``training.patches``): synchronized
   BatchNormalization, and the engine's own (``patches.AT_INIT``).

``shutdown()`` undoes them in reverse. Importing this module imports no framework and no Keras:
``import mgpu_launch`` stays light for scripts that use the host collectives only.
"""

import atexit
import sys

from mgpu_launch import backends, runtime
from mgpu_launch.config import settings

__all__ = ["init", "shutdown"]


def init(process_sets=None) -> None:
    """Join the job: the runtime, then the backend's engine, then the Keras patches.

    Idempotent: a second call only checks its `process_sets` against the first's. Call it at
    the top of the script, before building the model: TensorFlow's collectives can only be
    enabled before TensorFlow creates a tensor.

    Args:
        process_sets: as for ``mgpu_launch.runtime.init`` (None, a list of ``ProcessSet``,
            or ``"dynamic"``).

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
        return
    runtime.init(process_sets)
    atexit.register(shutdown)  # runs before the runtime's own (atexit runs last in, first out)
    state = runtime.state
    engine_wanted = settings.choice("MGPU_ENGINE") != "none"
    if state.size > 1 and engine_wanted:
        backends.get_engine().setup(state)
    _install_patches(state.size, engine_wanted)


def _install_patches(size: int, engine_wanted: bool) -> None:
    """BatchNormalization(synchronized=True) synchronizes (mgpu_launch.layers); on one process
    only if Keras is loaded already: importing it here would slow down every script that uses
    only the host collectives. On a job of several processes, the engine's own patches."""
    if not engine_wanted or (size == 1 and "keras" not in sys.modules):
        return
    from mgpu_launch.training import patches
    patches.install_synchronized_batch_norm()
    if size > 1:
        patches.install_at_init(backends.get_engine().name)


def shutdown() -> None:
    """Leave the job (runs at exit by itself): the engine first, then the runtime. Idempotent;
    ``init()`` may be called again."""
    if runtime.is_initialized():
        backends.reset()
    runtime.shutdown()
