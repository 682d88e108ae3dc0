"""The public path of mgpu-launch's Keras callbacks: ``mgpu.callbacks.X`` or
``from mgpu_launch.callbacks import X``.

The callbacks live in :mod:`mgpu_launch.training.callbacks`, one concern per module; this
module only re-exports them so that the name users import stays put.
"""

from mgpu_launch.training.callbacks import *  # noqa: F401,F403
from mgpu_launch.training.callbacks import __all__  # noqa: F401
