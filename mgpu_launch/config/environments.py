"""Where does this process stand in the job? Rank and size from the launcher's variables.

Every MPI launcher, Slurm and torchrun leave the process's place in the job in environment
variables, each under its own names. This module is a registry of one small class per launcher;
:func:`detect` asks them in priority order and returns the first that is active.

Priority (first active wins), and why:

1. Open MPI (``mpirun`` / ``mgpu-train -np N``) — the process was started by Open MPI itself.
2. MPICH / Intel MPI (Hydra's PMI variables) — likewise for the Hydra family.
3. Slurm (``srun``) — only inside a job *step*: a batch script's own environment also carries
   SLURM_PROCID=0 and SLURM_NTASKS, which every rank of an ``mpirun`` inside ``sbatch`` inherits,
   so a step id is required and the MPI launchers come first.
4. torchrun-style RANK / WORLD_SIZE — generic names many tools set.
5. JAX's JAX_PROCESS_ID / JAX_NUM_PROCESSES (with JAX_COORDINATOR_ADDRESS) — last.

None active means a single process (rank 0 of 1).

Two active environments that describe a job of the same size must agree on the rank; if they do
not, :class:`DetectionError` names both sets of variables.

Each environment also says how its ranks reach each other (JAX's ``ClusterEnv`` shape: rank,
size, local rank, coordinator address): its ``CONTROL_PLANE``, the transport its starter
provides (``"mpi"``: the ranks share an ``MPI_COMM_WORLD``), and, for a plane whose ranks
meet at a store, the coordinator's ``host:port`` read from its variables (torchrun's
``MASTER_ADDR`` / ``MASTER_PORT``). mgpu_launch.runtime.transport turns that into the job's
transport, or refuses a plane it does not have.
"""

import dataclasses
import os
from typing import Mapping, Optional, Sequence, Tuple


class DetectionError(ValueError):
    """The environment's rank variables are missing, malformed or contradict each other."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """This process's place in the job.

    Attributes:
        rank: global rank, 0 <= rank < size.
        size: number of processes in the job.
        local_rank: rank among the processes on this host.
        local_size: number of processes on this host.
        source: name of the environment that told us (``"single"`` when none did).
        control_plane: how the ranks talk (a key of mgpu_launch.runtime.transport.TRANSPORTS
            when supported, e.g. ``"mpi"``); None for a single process, which talks to no one.
        coordinator_address: ``host:port`` where the ranks meet, when the starter names one
            (torchrun); None where the control plane itself joins them (MPI).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    source: str
    control_plane: Optional[str] = "mpi"
    coordinator_address: Optional[str] = None


SINGLE_PROCESS = Placement(rank=0, size=1, local_rank=0, local_size=1, source="single",
                           control_plane=None)


def _read_int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None:
        raise DetectionError(f"{name} is not set, but the other variables of its launcher are")
    try:
        return int(value.strip())
    except ValueError:
        raise DetectionError(f"{name}={value!r} is not an integer") from None


class Environment:
    """One launcher's variables. Subclasses name them; `placement` reads and checks them.

    ``CONTROL_PLANE`` names the transport the launcher's ranks share (see the module
    docstring); a launcher whose ranks meet at a coordinator overrides
    :meth:`coordinator_address`.
    """

    name = ""
    RANK = SIZE = LOCAL_RANK = LOCAL_SIZE = ""
    CONTROL_PLANE = "mpi"

    def is_active(self, environ: Mapping[str, str]) -> bool:
        return self.RANK in environ

    def variable_names(self) -> Tuple[str, str, str, str]:
        return (self.RANK, self.SIZE, self.LOCAL_RANK, self.LOCAL_SIZE)

    def _local_size(self, environ: Mapping[str, str]) -> int:
        return _read_int(environ, self.LOCAL_SIZE)

    def coordinator_address(self, environ: Mapping[str, str]) -> Optional[str]:
        """``host:port`` where the ranks meet; None: the control plane joins them itself."""
        return None

    def placement(self, environ: Mapping[str, str]) -> Placement:
        rank, size = _read_int(environ, self.RANK), _read_int(environ, self.SIZE)
        local_rank, local_size = _read_int(environ, self.LOCAL_RANK), self._local_size(environ)
        names = self.variable_names()
        if size < 1:
            raise DetectionError(f"{self.name}: {names[1]}={size} must be at least 1")
        if not 0 <= rank < size:
            raise DetectionError(
                f"{self.name}: {names[0]}={rank} is not in [0, {names[1]}={size})")
        if not 1 <= local_size <= size:
            raise DetectionError(
                f"{self.name}: {names[3]}={local_size} is not in [1, {names[1]}={size}]")
        if not 0 <= local_rank < local_size:
            raise DetectionError(
                f"{self.name}: {names[2]}={local_rank} is not in [0, {names[3]}={local_size})")
        return Placement(rank, size, local_rank, local_size, self.name, self.CONTROL_PLANE,
                         self.coordinator_address(environ))


class OpenMPI(Environment):
    name = "openmpi"
    RANK, SIZE = "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"
    LOCAL_RANK, LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"


class MPICH(Environment):
    """MPICH, Intel MPI and MVAPICH (the Hydra process manager's PMI variables).

    Slurm's own ``srun --mpi=pmi2`` also sets PMI_RANK and PMI_SIZE (seen with Slurm 22.05),
    but never Hydra's MPI_LOCALRANKID: PMI variables without it inside a Slurm job step are
    Slurm's, and :class:`Slurm` reads that task's place.
    """

    name = "mpich"
    RANK, SIZE = "PMI_RANK", "PMI_SIZE"
    LOCAL_RANK, LOCAL_SIZE = "MPI_LOCALRANKID", "MPI_LOCALNRANKS"

    def is_active(self, environ: Mapping[str, str]) -> bool:
        from_slurm = self.LOCAL_RANK not in environ and Slurm.STEP_ID in environ
        return self.RANK in environ and not from_slurm


class Slurm(Environment):
    """A task of an ``srun`` job step.

    Slurm gives no per-node task count directly: SLURM_TASKS_PER_NODE is a compressed list such
    as ``"2(x3),1"`` and SLURM_NODEID says which entry is ours.
    """

    name = "slurm"
    RANK, SIZE, LOCAL_RANK = "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
    LOCAL_SIZE = "SLURM_TASKS_PER_NODE"
    STEP_ID, NODE_ID = "SLURM_STEP_ID", "SLURM_NODEID"

    def is_active(self, environ: Mapping[str, str]) -> bool:
        return self.RANK in environ and self.STEP_ID in environ

    def _local_size(self, environ: Mapping[str, str]) -> int:
        spec = environ.get(self.LOCAL_SIZE, "")
        node = _read_int(environ, self.NODE_ID)
        counts = expand_tasks_per_node(spec)
        if not 0 <= node < len(counts):
            raise DetectionError(
                f"slurm: {self.NODE_ID}={node} has no entry in {self.LOCAL_SIZE}={spec!r}")
        return counts[node]


def expand_tasks_per_node(spec: str) -> Sequence[int]:
    """Expand Slurm's compressed task list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for item in filter(None, spec.split(",")):
        count, _, repeat = item.partition("(x")
        try:
            counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
        except ValueError:
            raise DetectionError(
                f"SLURM_TASKS_PER_NODE={spec!r} does not parse (expected e.g. '2(x3),1')") from None
    if not counts:
        raise DetectionError("SLURM_TASKS_PER_NODE is empty or not set inside a Slurm job step")
    return counts


class TorchRun(Environment):
    """torchrun (and tools that set its names). Its ranks share no MPI world: they meet at
    torch's TCP store on the coordinator, ``MASTER_ADDR:MASTER_PORT``."""

    name = "torchrun"
    RANK, SIZE, LOCAL_RANK, LOCAL_SIZE = "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
    ADDRESS, PORT = "MASTER_ADDR", "MASTER_PORT"
    CONTROL_PLANE = "torch.distributed"

    def coordinator_address(self, environ: Mapping[str, str]) -> Optional[str]:
        """``MASTER_ADDR:MASTER_PORT``; None unless both are set and the port is a number
        (only a job on that plane dials it; the others must not fail on a stray variable)."""
        host, port = environ.get(self.ADDRESS, "").strip(), environ.get(self.PORT, "").strip()
        if not host or not port.isdigit():
            return None
        return f"[{host}]:{int(port)}" if ":" in host else f"{host}:{int(port)}"


class JaxProcesses(Environment):
    """Processes started with JAX's variables (a JAX platform launcher, or N plain starts):
    ``JAX_PROCESS_ID`` of ``JAX_NUM_PROCESSES``, meeting at JAX's coordination service on
    ``JAX_COORDINATOR_ADDRESS`` (which ``jax.distributed.initialize`` itself reads).

    They name no local rank: the placement counts every process as this host's until
    ``mgpu.init()`` groups the ranks by host over the control plane (local rank and size
    come from there, as on every plane). On GPUs, JAX's own ``JAX_LOCAL_DEVICE_IDS`` picks a
    process's device.
    """

    name = "jax-variables"
    RANK, SIZE = "JAX_PROCESS_ID", "JAX_NUM_PROCESSES"
    LOCAL_RANK, LOCAL_SIZE = RANK, SIZE
    ADDRESS = "JAX_COORDINATOR_ADDRESS"
    CONTROL_PLANE = "jax.distributed"

    def coordinator_address(self, environ: Mapping[str, str]) -> Optional[str]:
        """``JAX_COORDINATOR_ADDRESS`` when it is ``host:port`` with a numeric port."""
        host, _, port = environ.get(self.ADDRESS, "").strip().rpartition(":")
        return f"{host}:{int(port)}" if host and port.isdigit() else None


#: Priority order, strongest evidence first (see the module docstring).
ENVIRONMENTS: Tuple[Environment, ...] = (OpenMPI(), MPICH(), Slurm(), TorchRun(),
                                         JaxProcesses())


def active_placements(environ: Optional[Mapping[str, str]] = None) -> Sequence[Placement]:
    """Every active environment's placement, in priority order (raises on a malformed one)."""
    environ = os.environ if environ is None else environ
    return [env.placement(environ) for env in ENVIRONMENTS if env.is_active(environ)]


def detect(environ: Optional[Mapping[str, str]] = None) -> Placement:
    """Return this process's placement from the environment.

    Args:
        environ: the variables to read; defaults to ``os.environ``.

    Returns:
        The :class:`Placement` of the highest-priority active environment, or
        ``SINGLE_PROCESS`` when no launcher variables are present.

    Raises:
        DetectionError: a variable is malformed or out of range, or two environments that
            describe a job of the same size disagree on this process's rank.

    Example:
        >>> detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        ...         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}).rank
        1
    """
    found = active_placements(environ)
    if not found:
        return SINGLE_PROCESS
    chosen = found[0]
    for other in found[1:]:
        if other.size == chosen.size and other.rank != chosen.rank:
            names = {env.name: env.variable_names() for env in ENVIRONMENTS}
            raise DetectionError(
                f"contradictory rank variables: {chosen.source} says rank {chosen.rank} of "
                f"{chosen.size} ({names[chosen.source][0]}), {other.source} says rank "
                f"{other.rank} of {other.size} ({names[other.source][0]}). Unset the stale "
                f"ones (e.g. left over from an outer launcher) before starting the job.")
    return chosen
