"""What the rest of mgpu must know about a backend without importing it: one frozen value each.

Each backend folder's ``__init__.py`` declares its :class:`BackendFacts` as ``FACTS`` and
imports no framework, so that the launcher (``mgpu-train``: the usage check, GPU pinning,
``--env``) reads them in a fraction of a second; ``mgpu_launch.backends`` collects them, one
registry line per backend.
"""

import dataclasses
from typing import Tuple

__all__ = ["BackendFacts"]


@dataclasses.dataclass(frozen=True)
class BackendFacts:
    """One Keras backend as mgpu knows it before any framework is imported.

    Args:
        name: the Keras backend's name (``KERAS_BACKEND``).
        engine: ``"module:Class"`` of its engine, imported on first use.
        pins_by_visible_devices: whether a worker's GPU is pinned by setting
            ``CUDA_VISIBLE_DEVICES`` to it alone (False: every GPU stays visible and the engine
            picks ``MGPU_LOCAL_DEVICE`` itself; JAX's topology exchange hangs otherwise).
        packages: the distributions ``mgpu-train --env`` reports for it, in order.
        keras_synchronizes_batch_norm: Keras's own ``BatchNormalization(synchronized=True)``
            has a path here (TensorFlow: a ``tf.distribute`` strategy's, or local statistics),
            which mgpu's patch leaves to Keras where it has no statistics of its own.
    """

    name: str
    engine: str
    pins_by_visible_devices: bool
    packages: Tuple[str, ...]
    keras_synchronizes_batch_norm: bool = False
