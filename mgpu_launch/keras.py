"""The public path of Horovod's ``horovod.tensorflow.keras`` names:
``import mgpu_launch.keras as hvd``.

The names live in :mod:`mgpu_launch.horovod.keras_api` (its docstring, shown by ``help(hvd)``,
lists what differs from Horovod); this module only re-exports them so that the import line a
Horovod user changes stays put. ``hvd.callbacks`` and ``hvd.elastic`` are importable as
``mgpu_launch.keras.callbacks`` / ``mgpu_launch.keras.elastic`` too, as with Horovod.
"""

from mgpu_launch.horovod.keras_api import *  # noqa: F401,F403
from mgpu_launch.horovod.keras_api import __all__, __doc__, __getattr__, elastic  # noqa: F401
