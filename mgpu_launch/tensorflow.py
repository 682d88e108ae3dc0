"""The public path of Horovod's ``horovod.tensorflow`` names:
``import mgpu_launch.tensorflow as hvd``.

The names live in :mod:`mgpu_launch.horovod.tensorflow_api` (its docstring, shown by
``help(hvd)``, lists what differs from Horovod); this module only re-exports them so that the
import line a Horovod user changes stays put.
"""

from mgpu_launch.horovod.tensorflow_api import *  # noqa: F401,F403
from mgpu_launch.horovod.tensorflow_api import __all__, __doc__, __getattr__  # noqa: F401
