"""The runtime layer's exceptions, in one module below the others so that each may raise them.

Users import them from where they meet them: ``mgpu.NotInitializedError``,
``mgpu.MismatchError``, ``mgpu.NotInProcessSetError`` (and ``mgpu_launch.runtime`` /
``mgpu_launch.runtime.collectives`` / ``mgpu_launch.runtime.process_sets``).
"""


class NotInitializedError(RuntimeError):
    """A collective or topology query ran before ``mgpu.init()``."""

    __module__ = "mgpu_launch.runtime"  # where it always lived (tracebacks, pickles)


class MismatchError(ValueError):
    """Ranks called the same collective with values that cannot be combined."""

    __module__ = "mgpu_launch.runtime.collectives"


class NotInProcessSetError(ValueError):
    """This rank called a collective on (or asked its rank in) a process set it is not in
    (Horovod: "Rank r is not a member of the provided process set")."""

    __module__ = "mgpu_launch.runtime.process_sets"
