"""The public path of data sharding: ``mgpu.data.shard(...)`` or ``from mgpu_launch.data import
shard``.

The code lives in :mod:`mgpu_launch.training.data` (sharding) and
:mod:`mgpu_launch.training.prefetch` (the device prefetcher); this module only re-exports them
so that the name users import stays put.
"""

from mgpu_launch.training.data import *  # noqa: F401,F403
from mgpu_launch.training.data import __all__  # noqa: F401
