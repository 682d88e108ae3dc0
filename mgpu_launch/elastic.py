"""The public path of Horovod's ``hvd.elastic`` Keras names (also ``mgpu_launch.keras.elastic``).

The names live in :mod:`mgpu_launch.horovod.elastic`, whose docstring says how mgpu-launch's
restart-based elastic training differs from Horovod's rollback; this module only re-exports
them so that the name users import stays put.
"""

from mgpu_launch.horovod.elastic import *  # noqa: F401,F403
from mgpu_launch.horovod.elastic import __all__  # noqa: F401
