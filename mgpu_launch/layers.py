"""The public path of mgpu-launch's Keras layers: ``mgpu.layers.SyncBatchNormalization``.

The layer lives in :mod:`mgpu_launch.training.layers` (with the semantics and cost of
synchronized BatchNormalization); this module only re-exports it so that the name users import
stays put.
"""

from mgpu_launch.training.layers import *  # noqa: F401,F403
from mgpu_launch.training.layers import __all__  # noqa: F401
