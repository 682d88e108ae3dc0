"""The runtime layer: the process's place in the job, and what it talks to the other ranks with.

Nothing here imports Keras or a deep-learning framework: a script that only needs the
topology and the host collectives pays for neither. Its modules, lowest first:

    transport       the control plane: the Transport interface every rank talks through
                    (objects, buffers, groups) and the one choice of its implementation
    transport_mpi   the MPI transport (mpi4py), the one module that touches MPI
    transport_torch the torch.distributed transport (torchrun's store + gloo), imported only
                    when a torchrun job joins it
    transport_jax   the jax.distributed transport (JAX's coordination service), likewise
    auth            the per-job key and the authenticated framing of every message mgpu reads
                    from a socket (the stall inspector's channel, run()'s results)
    folders         the check of every folder mgpu writes into and reads back from (run()'s
                    work folder, backups, the elastic state): yours alone, path included
    rendezvous      where the ranks meet: the job's host address, free ports, bind addresses
    stall_channel   the stall inspector's authenticated line protocol
    stall           the stall inspector: which rank waits where, named when a step stalls
    timeline        every rank's step phases and host collectives, merged into one trace
    trace_files     the timeline's JSON trace format, its atomic writes, merging dumps
    timeline_signals  a rank ended by SIGTERM writes its timeline first
    errors          the layer's exceptions (NotInitializedError, MismatchError, ...)
    process_set_table  the registered process sets, their sub-groups of the transport, the
                    engines' listeners
    process_sets    Horovod's process sets: ProcessSet, init's sets, add / remove, the
                    lookup every collective's process_set= goes through
    this module     init() / shutdown(), the topology (rank, size, local, cross), the
                    transport: one state object
    collectives     host collectives over the transport (allreduce, allgather, broadcast,
                    barrier) with the mismatch checks that turn a would-be hang into an
                    error, over every rank or within a process set
    agreement       one rank decides, every rank raises alike (a refusal never hangs)
    launch          mgpu_launch.run(): a Python function on N ranks from a notebook or script

The layers above (engines, training, horovod) import from here; nothing here imports them.

The process's place in the job, and the control plane behind it: one state object.

``init()`` reads the placement the launcher left in the environment (mgpu_launch.config.environments),
joins the control plane that environment names when there is more than one process
(``transport.join``: MPI, torch.distributed under torchrun, or jax.distributed with JAX's
variables), and derives the local (same host) and cross (same local rank, across hosts) groups
the way Horovod does. With one process and no launcher it starts nothing: every collective is
then a copy, and costs nothing measurable.
"""

import atexit
import dataclasses
import sys
from typing import Any, Callable, List, Optional, Tuple

from mgpu_launch.runtime import auth, process_sets as _process_sets, stall, timeline, transport
from mgpu_launch.runtime.errors import NotInitializedError
from mgpu_launch.runtime.transport import Transport
from mgpu_launch.config import markers
from mgpu_launch.config import environments, settings


@dataclasses.dataclass
class State:
    """Everything ``init()`` sets up; one instance per process (``runtime.state``)."""

    initialized: bool = False
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    source: str = "single"
    #: the control plane every rank joined (runtime.transport.join), None on one process
    transport: Optional[Transport] = None
    host_address: Optional[str] = None  # as the other hosts dial it (rendezvous.job_host_address)
    job_key: Optional[bytes] = None  # rank 0's random secret of this job (mgpu_launch.runtime.auth)
    previous_excepthook: Any = None

    def require(self) -> "State":
        if not self.initialized:
            raise NotInitializedError(
                "mgpu_launch is not initialized: call mgpu.init() at the start of the "
                "training script, before any other mgpu function")
        return self


state = State()

#: (start(state), stop()) of this layer's services, run by init() after the transport is up
#: and by shutdown() before it goes (stopped in reverse): the stall inspector and the timeline
#: (MGPU_TIMELINE). The engines and the Keras patches are started above this layer, by
#: mgpu.init() (mgpu_launch.training.bootstrap), never from here.
_SERVICES: Tuple[Tuple[Callable[[State], None], Callable[[], None]], ...] = (
    (stall.start, stall.stop), (timeline.on_init, timeline.on_shutdown))


def _abort_on_uncaught(exc_type, exc, tb):
    """Print as python would, then abort the MPI job so no rank waits in a collective forever."""
    (state.previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)
    timeline.dump_own("uncaught exception")  # the collective write at shutdown never comes
    status = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
    markers.abort_job(status, markers.describe_exception(exc, status))


def init(process_sets=None) -> None:
    """Join the job: this layer's part of ``mgpu.init()``. Idempotent: a second call does
    nothing.

    Works with no launcher at all (a 1-process job), under ``mgpu-train``, ``mpirun``/``mpiexec``,
    ``srun``, torchrun and with JAX's variables (docs/torchrun.md). ``mgpu.init()``
    (mgpu_launch.training.bootstrap) calls it first, then sets up
    the Keras backend's engine and the Keras patches; call that one from a training script.
    On more than one process it starts the stall inspector (mgpu_launch.runtime.stall; knobs
    ``MGPU_STALL_WARNING_S``, ``MGPU_STALL_SHUTDOWN_S``, ``MGPU_STALL_INSPECTOR``).
    First it checks every ``MGPU_*`` variable (mgpu_launch.config.settings; docs/settings.md) and
    warns, on rank 0, about a name it does not know.

    Args:
        process_sets: None; a list of :class:`~mgpu_launch.runtime.process_sets.ProcessSet`
            to register (the same on every rank; the collectives' ``process_set=`` then
            takes them); or ``"dynamic"``: none now, :func:`add_process_set` later (as does
            ``MGPU_DYNAMIC_PROCESS_SETS=1``, with or without a list). See
            mgpu_launch.runtime.process_sets.

    Raises:
        mgpu_launch.config.settings.SettingError: an ``MGPU_*`` variable has a bad value (a
            ValueError; the message names the variable, the value and an example).
        mgpu_launch.config.environments.DetectionError: the launcher's variables are contradictory.
        RuntimeError: the ranks were started by a launcher whose control plane is not
            supported (the message lists those that are), or the environment and the
            transport (MPI) disagree on the job's size or this rank.
        ValueError: `process_sets` is neither None, a list of ProcessSet nor "dynamic", holds
            ranks outside the job or the same ranks twice; or a later call passes sets that
            the first did not register.
        MismatchError: the ranks passed different `process_sets`.

    Example:
        >>> import mgpu_launch as mgpu
        >>> mgpu.init()
        >>> mgpu.size() >= 1
        True
    """
    if state.initialized:
        _process_sets.check_registered(process_sets)
        return
    dynamic = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
    if isinstance(process_sets, str) and not dynamic:
        raise ValueError(f"init(process_sets={process_sets!r}): expected None, a list of "
                         f"mgpu.ProcessSet, or 'dynamic'")
    settings.check()
    placement = environments.detect()
    if placement.rank == 0:
        settings.warn_unknown()
    fresh = State(initialized=True, rank=placement.rank, size=placement.size,
                  local_rank=placement.local_rank, local_size=placement.local_size,
                  source=placement.source)
    if placement.size > 1:
        joined = transport.join(placement)  # the one choice of the control plane
        local = joined.split_by_host()
        cross = joined.split(color=local.rank, key=joined.rank)
        fresh.local_rank, fresh.local_size = local.rank, local.size
        fresh.cross_rank, fresh.cross_size = cross.rank, cross.size
        local.close()
        cross.close()
        fresh.transport = joined
        fresh.job_key = auth.share_job_key(joined)  # the bootstrap every rank joined through
        fresh.previous_excepthook = sys.excepthook
        sys.excepthook = _abort_on_uncaught
    _process_sets.start(fresh, None if dynamic else process_sets,
                        dynamic or settings.flag("MGPU_DYNAMIC_PROCESS_SETS"))
    vars(state).update(vars(fresh))
    atexit.register(shutdown)
    for start, _ in _SERVICES:
        start(state)


def shutdown() -> None:
    """Leave the job (runs at exit by itself). Idempotent; ``init()`` may be called again."""
    if not state.initialized:
        return
    for _, stop in reversed(_SERVICES):
        stop()
    _process_sets.stop()
    if state.transport is not None:
        state.transport.close()
    if sys.excepthook is _abort_on_uncaught:
        sys.excepthook = state.previous_excepthook
    vars(state).update(vars(State()))


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return state.initialized


def size() -> int:
    """Number of processes in the job."""
    return state.require().size


def rank() -> int:
    """This process's global rank, 0 <= rank < size()."""
    return state.require().rank


def local_rank() -> int:
    """Rank among the processes on this host (the GPU it is pinned to)."""
    return state.require().local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return state.require().local_size


def cross_rank() -> int:
    """Index of this host among the hosts (rank among the processes with this local rank)."""
    return state.require().cross_rank


def cross_size() -> int:
    """Number of hosts (processes with this local rank)."""
    return state.require().cross_size


def is_chief() -> bool:
    """True on rank 0, the one process that writes checkpoints and logs."""
    return state.require().rank == 0


def is_multi_process() -> bool:
    """True when initialized with more than one process (the only case with anything to reduce)."""
    return state.initialized and state.size > 1

