"""The control plane: how the ranks of a job reach each other outside the compiled step.

Everything the runtime says to the other ranks goes through one :class:`Transport`: the job
key, the host collectives (``mgpu_launch.runtime.collectives``), the process sets' groups, the
rendezvous the engines start their frameworks from, the stall inspector's address, the
timeline's clock offsets. Gradients do not: they travel inside the compiled step, over the
backend's own communicator (NCCL, gloo, gRPC), which the engines bootstrap over this one.

One implementation per starter, each in a module of its own that alone imports its library:
MPI (:mod:`mgpu_launch.runtime.transport_mpi`, mpi4py; the ranks ``mpirun``, ``srun
--mpi=pmix`` and ``mgpu-train -np N`` start) and torch.distributed
(:mod:`mgpu_launch.runtime.transport_torch`: torchrun's TCP store and a gloo group; the ranks
torchrun or a Kubeflow PyTorchJob start) and jax.distributed
(:mod:`mgpu_launch.runtime.transport_jax`: JAX's coordination service; the processes started
with JAX's variables). Which one a job uses is decided once, by
:func:`join`, from the environment that started the ranks
(:class:`mgpu_launch.config.environments.Placement`: its ``control_plane``, and the
``coordinator_address`` a store-based plane dials). A new control plane (a Kubernetes JobSet's,
say) is one module here with a subclass of
:class:`Transport` and a ``join(placement)``, one line in :data:`TRANSPORTS`, and the
environment that names it (docs/architecture.md, "Where a new thing goes"). Shapes: JAX's
``ClusterEnv`` (``jax/_src/clusters/cluster.py``) read once by ``State.initialize``; torch's
``RendezvousHandler.next_rendezvous() -> (store, rank, world_size)``.

The interface has no default implementations: a transport that misses a method fails when it
is made (``TypeError`` from :mod:`abc`), not at the first call on a running job. The array
collectives (``*_array``) move numpy buffers for the host collectives on numbers and arrays
and for TensorFlow's ``MGPU_TF_TRANSPORT=mpi`` path; a plane without buffer collectives of its
own implements them with the object ones. Every method is a collective over the transport's
ranks unless it says otherwise: call it on every rank, in the same order.
"""

import abc
import importlib
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["Transport", "TRANSPORTS", "REDUCE_OPS", "join", "supported"]

#: the elementwise reductions :meth:`Transport.allreduce_array` takes
REDUCE_OPS = ("sum", "min", "max", "product")

#: control plane name (an environment's ``CONTROL_PLANE``) -> the module that joins it, whose
#: ``join(placement)`` returns the :class:`Transport`; the one list of what is supported
TRANSPORTS: Dict[str, str] = {
    "mpi": "mgpu_launch.runtime.transport_mpi",
    "torch.distributed": "mgpu_launch.runtime.transport_torch",
    "jax.distributed": "mgpu_launch.runtime.transport_jax",
}

#: how each supported plane's ranks are started, for the refusal of any other
_STARTED_BY = {"mpi": "mgpu-train -np N, mpirun / mpiexec (Open MPI, MPICH, Intel MPI) or "
                      "srun --mpi=pmix",
               "torch.distributed": "torchrun, or a Kubeflow PyTorchJob: RANK, WORLD_SIZE, "
                                    "MASTER_ADDR, MASTER_PORT",
               "jax.distributed": "JAX's variables: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                                  "JAX_PROCESS_ID"}


class Transport(abc.ABC):
    """One group of ranks that can talk: the whole job, a host's ranks, or a process set's.

    ``rank`` and ``size`` are this process's position in the group and the group's size.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The control plane's name, a key of :data:`TRANSPORTS` (not a collective)."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's position in the group, 0 <= rank < size (not a collective)."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """The number of ranks in the group (not a collective)."""

    @abc.abstractmethod
    def thread_safe(self) -> bool:
        """Whether two threads of a rank may call the transport at once (not a collective)."""

    # -- objects (anything that pickles) --------------------------------------------------------
    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Rank `root`'s `obj`, on every rank (the others' `obj` is ignored)."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> List[Any]:
        """Every rank's `obj`, as a list in rank order."""

    @abc.abstractmethod
    def gather_object(self, obj: Any, root: int) -> Optional[List[Any]]:
        """Every rank's `obj` as a list in rank order on rank `root`; None on the others."""

    @abc.abstractmethod
    def send_object(self, obj: Any, dest: int, tag: int) -> None:
        """Send `obj` to rank `dest` alone (point to point, not a collective)."""

    @abc.abstractmethod
    def receive_object(self, source: int, tag: int) -> Any:
        """The object rank `source` sent with `tag` (point to point, not a collective)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return when every rank has called it."""

    # -- numpy buffers --------------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce_array(self, array: Any, op: str) -> Any:
        """A new array: `array` combined elementwise over the ranks by `op` (one of
        :data:`REDUCE_OPS`); the same shape and dtype on every rank."""

    @abc.abstractmethod
    def allgather_array(self, array: Any, rows: Sequence[int]) -> Any:
        """Every rank's C-contiguous `array` concatenated along axis 0, in rank order; `rows`
        holds every rank's first dimension (the trailing shape and dtype are the same)."""

    @abc.abstractmethod
    def broadcast_array(self, array: Any, root: int) -> Any:
        """A copy of rank `root`'s `array` (same shape and dtype on every rank)."""

    # -- groups ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def split(self, color: Optional[int], key: int) -> Optional["Transport"]:
        """The group of the ranks that pass the same `color`, ordered by `key`; None for a
        rank that passes None (it joins no group). A collective over every rank."""

    @abc.abstractmethod
    def split_by_host(self) -> "Transport":
        """The group of the ranks on this rank's host, ordered by rank."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let the group go (a rank's own step, not a collective); nothing may use it after."""


def supported() -> str:
    """The control planes this build joins, and what starts their ranks, in words."""
    return "; ".join(f"{name} ({_STARTED_BY[name]})" for name in TRANSPORTS)


def join(placement) -> Transport:
    """The transport of this job, for the rank `placement` describes (the one decision).

    Args:
        placement: :class:`mgpu_launch.config.environments.Placement` of a multi-process job.

    Returns:
        The joined :class:`Transport` of every rank; its rank and size are the placement's.

    Raises:
        RuntimeError: the environment that started the ranks needs a control plane this build
            does not have (the message names the supported ones and what starts them), or the
            transport and the environment disagree on the job's size or this rank.
    """
    plane = placement.control_plane
    if plane not in TRANSPORTS:
        coordinator = (f", coordinator {placement.coordinator_address}"
                       if placement.coordinator_address else "")
        raise RuntimeError(
            f"{placement.source} started this job ({placement.size} processes{coordinator}); "
            f"its ranks meet over the {plane!r} control plane, which mgpu-launch does not "
            f"support yet. Supported: {supported()}. Start the job with one of those.")
    return importlib.import_module(TRANSPORTS[plane]).join(placement)
