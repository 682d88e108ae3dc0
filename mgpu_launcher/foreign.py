"""The variables other launchers give their processes, so that scripts written for them run
unchanged under ``mgpu-train``.

Two kinds of script start their own communication instead of calling ``mgpu.init()``:

* Keras's distribution API: ``keras.distribution.initialize()`` reads
  ``KERAS_DISTRIBUTION_JOB_ADDRESSES`` (comma-separated, the coordinator first: on JAX only that
  one is used, and Keras checks their count against ``num_processes``),
  ``KERAS_DISTRIBUTION_NUM_PROCESSES`` and ``KERAS_DISTRIBUTION_PROCESS_ID``;
* torchrun-style scripts (``init_process_group()`` from ``env://``): ``WORLD_SIZE``, ``RANK``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (this host's
  index among the job's hosts, and their number; only where they are known, see below),
  ``MASTER_ADDR`` and ``MASTER_PORT``. Not ``TORCHELASTIC_RUN_ID``: no elastic agent runs, and
  ``torch.distributed.is_torchelastic_launched()`` must keep saying so.

Both get the same coordinator: rank 0's host and a free port, agreed by every rank before the
program starts (:func:`coordinator`):

1. ``MGPU_COORDINATOR`` when set. ``mgpu-train -np N`` sets it for a job on its own host:
   ``127.0.0.1`` and a port that mgpu-train holds for as long as it runs
   (:func:`launcher_coordinator`), so no rank pays for an exchange. A user may set it to
   ``HOST:PORT`` of rank 0's host.
2. A job of one process: ``127.0.0.1`` and a port this process holds.
3. Otherwise over MPI, before the program runs: the ranks share their host names, rank 0 picks
   its address as the other hosts dial it and a port it holds, and broadcasts both. MPI then
   stays initialized for the program (``mgpu.init()`` uses it as it is). Measured on the 2-core
   CPU box under load: ``MPI_Init`` ~1.1 s a process, the exchange ~10 ms; an mgpu script pays
   the ``MPI_Init`` anyway.
4. MPI does not span the job (``srun`` without ``--mpi=pmix``): rank 0 warns, and neither the
   coordinator nor the ``KERAS_DISTRIBUTION_*`` variables are exported (Keras then leaves it to
   JAX's own cluster detection, untested here; a torchrun-style script fails at once on the
   missing ``MASTER_ADDR``).

JAX's coordinator binds the address it is dialled at (``JAX_COORDINATOR_BIND_ADDRESS``, also
exported; ``MGPU_BIND_ADDRESS`` chooses another host), not every interface as JAX's default
does (measured: ``*:PORT`` without it, ``127.0.0.1`` with it, on one host). A script that passes
its own ``job_addresses`` must then unset it.

Left as they are: everything when torchrun started the ranks (its variables are the truth, and
its store holds ``MASTER_PORT``); the three ``KERAS_DISTRIBUTION_*`` variables when
``KERAS_DISTRIBUTION_JOB_ADDRESSES`` is already set; ``MASTER_ADDR`` and ``MASTER_PORT`` when
either is set (a batch script's own choice).

GPUs: a JAX rank sees every GPU of its host, so it also gets ``JAX_LOCAL_DEVICE_IDS``, its
pinned GPU (:func:`export_jax_device`). ``LOCAL_RANK`` is the process's rank on its host, as
torchrun sets it. With pinning (the default) a torch rank sees its one GPU as ``cuda:0``; a
script that picks ``cuda:LOCAL_RANK`` needs ``mgpu-train --no-pin`` (every GPU visible, as
under torchrun).
docs/starting-processes.md says which launcher runs which kind of script.
"""

import ipaddress
import os
import socket
import sys
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

from mgpu_launch.config import environments, settings

#: set by mgpu-train -np N on one host, or by a user: rank 0's host and the port (HOST:PORT)
COORDINATOR_VARIABLE = "MGPU_COORDINATOR"

KERAS_ADDRESSES = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
KERAS_NUM_PROCESSES = "KERAS_DISTRIBUTION_NUM_PROCESSES"
KERAS_PROCESS_ID = "KERAS_DISTRIBUTION_PROCESS_ID"

WORLD_SIZE, RANK = "WORLD_SIZE", "RANK"
LOCAL_RANK, LOCAL_WORLD_SIZE = "LOCAL_RANK", "LOCAL_WORLD_SIZE"
GROUP_RANK, GROUP_WORLD_SIZE = "GROUP_RANK", "GROUP_WORLD_SIZE"
MASTER_ADDR, MASTER_PORT = "MASTER_ADDR", "MASTER_PORT"
#: the interface gloo binds (a DDP script's CPU collectives), set for a job on several hosts
GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"
#: where JAX's coordinator binds (jax.distributed.initialize reads it when given no bind address)
JAX_BIND = "JAX_COORDINATOR_BIND_ADDRESS"
#: the GPUs a JAX process takes (jax.distributed.initialize reads it when given none)
JAX_DEVICES = "JAX_LOCAL_DEVICE_IDS"

#: ports held for the life of this process (a listener of the program binds them meanwhile)
_held: List[socket.socket] = []
#: what export() set in this process: a job this process starts (mgpu_launch.run from a
#: script that mgpu-train runs) must not hand it on to its own ranks
_exported: Dict[str, str] = {}


def _hold_port() -> int:
    """A free TCP port, bound here (``SO_REUSEADDR``, never listening) until this process ends.

    No other socket gets the port from the kernel meanwhile, yet a server that also sets
    ``SO_REUSEADDR`` (JAX's coordinator, torch's TCPStore) binds and listens on it, in this
    process or a child (see mgpu_launch.runtime.rendezvous.reserved_port).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    _held.append(sock)
    return sock.getsockname()[1]


def launcher_coordinator() -> str:
    """``127.0.0.1:PORT`` for a job whose ranks all run on this host (``mgpu-train -np N``).

    The port stays held by this process (mgpu-train) while it runs, so every attempt of the job
    (``--max-restarts``, elastic) gets the same one; called again, it returns the same address.
    """
    if not _held:
        _hold_port()
    return f"127.0.0.1:{_held[0].getsockname()[1]}"


class NoAgreement(RuntimeError):
    """The ranks cannot agree on a coordinator before the program starts."""


def _mpi_spans_job(placement: environments.Placement, environ: Mapping[str, str]) -> bool:
    """Whether MPI_Init will give the job's own ranks (without starting MPI to find out)."""
    if placement.source in ("openmpi", "mpich"):
        return True
    # srun starts Open MPI's ranks through PMIx only (``--mpi=pmix``); PMI-2 or none gives
    # singletons (tests/test_slurm.py).
    return placement.source == "slurm" and "PMIX_RANK" in environ


def _agree_over_mpi(placement: environments.Placement
                    ) -> Tuple[str, Sequence[str], int, int]:
    """(coordinator, each rank's host name, this host's index, number of hosts), over MPI."""
    from mgpu_launch.runtime import transport_mpi  # initializes MPI; mgpu.init() reuses it

    try:
        world = transport_mpi.join(placement)
    except RuntimeError as error:  # MPI does not span the job
        raise NoAgreement(str(error)) from error
    try:
        own = socket.gethostname()
        names = world.allgather_object(own)
        address = problem = None
        if placement.rank == 0:
            try:
                if len(set(names)) == 1:
                    host = "127.0.0.1"
                else:
                    from mgpu_launch.runtime.rendezvous import host_address
                    host = host_address(sorted(set(names) - {own}))
                address = f"{host}:{_hold_port()}"
            except OSError as error:  # said on every rank: none waits for an address never sent
                problem = f"rank 0 found no free port ({error})"
        address, problem = world.broadcast_object((address, problem), root=0)
    finally:
        world.close()
    if problem:
        raise NoAgreement(problem)
    hosts = list(dict.fromkeys(names))  # in rank order: host 0 holds rank 0
    return address, names, hosts.index(own), len(hosts)


def coordinator(placement: environments.Placement, environ: Mapping[str, str]
                ) -> Tuple[str, Optional[Sequence[str]], Optional[Tuple[int, int]]]:
    """Rank 0's ``HOST:PORT``, each rank's host (None: not known) and (host index, hosts).

    Collective when it goes over MPI (see the module docstring for the order).

    Raises:
        NoAgreement: MPI does not span the job and no ``MGPU_COORDINATOR`` is set.
        settings.SettingError: ``MGPU_COORDINATOR`` is not ``HOST:PORT``.
    """
    one_host = (0, 1) if placement.local_size == placement.size else None
    given = settings.text(COORDINATOR_VARIABLE, environ)
    if given:
        return given, None, one_host
    if placement.size == 1:
        return f"127.0.0.1:{_hold_port()}", None, one_host
    if not _mpi_spans_job(placement, environ):
        raise NoAgreement(f"{placement.source} started these ranks without MPI to exchange "
                          f"it over")
    address, names, index, count = _agree_over_mpi(placement)
    return address, names, (index, count)


def keras_variables(placement: environments.Placement, address: str,
                    hosts: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """``KERAS_DISTRIBUTION_*`` for this rank: one address per process, the coordinator first.

    The others name each rank's host (when `hosts` says) with the coordinator's port: JAX reads
    only the first, but Keras compares their count with a ``num_processes`` the script passes,
    so a script that asks for another count fails at once on every rank instead of waiting.

    Example:
        >>> keras_variables(environments.Placement(1, 2, 1, 2, "openmpi"), "127.0.0.1:4000")
        ... # doctest: +NORMALIZE_WHITESPACE
        {'KERAS_DISTRIBUTION_JOB_ADDRESSES': '127.0.0.1:4000,127.0.0.1:4000',
         'KERAS_DISTRIBUTION_NUM_PROCESSES': '2', 'KERAS_DISTRIBUTION_PROCESS_ID': '1'}
    """
    port = address.rpartition(":")[2]
    others = [f"{hosts[rank]}:{port}" if hosts else address for rank in range(1, placement.size)]
    return {KERAS_ADDRESSES: ",".join([address, *others]),
            KERAS_NUM_PROCESSES: str(placement.size), KERAS_PROCESS_ID: str(placement.rank)}


def torchrun_variables(placement: environments.Placement, address: Optional[str],
                       group: Optional[Tuple[int, int]]) -> Dict[str, str]:
    """torchrun's variables for this rank; ``MASTER_*`` when `address` is given, ``GROUP_*`` when
    `group` (this host's index, the number of hosts) is."""
    found = {WORLD_SIZE: str(placement.size), RANK: str(placement.rank),
             LOCAL_RANK: str(placement.local_rank), LOCAL_WORLD_SIZE: str(placement.local_size)}
    if group is not None:
        found.update({GROUP_RANK: str(group[0]), GROUP_WORLD_SIZE: str(group[1])})
    if address is not None:
        host, _, port = address.rpartition(":")
        found.update({MASTER_ADDR: host.strip("[]"), MASTER_PORT: port})
    return found


def jax_bind_address(address: str, environ: Mapping[str, str]) -> Optional[str]:
    """Where JAX's coordinator (started by ``keras.distribution.initialize()`` on rank 0) binds:
    the address it is dialled at, or ``MGPU_BIND_ADDRESS``'s host; None to leave JAX's default
    (every interface, ``[::]:PORT``): the variable is set already, or the host is a name.

    Example:
        >>> jax_bind_address("127.0.0.1:4000", {})
        '127.0.0.1:4000'
    """
    if JAX_BIND in environ:
        return None
    host, _, port = address.rpartition(":")
    host = settings.text("MGPU_BIND_ADDRESS", environ) or host
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return f"{host}:{port}"


def export(placement: environments.Placement, environ: MutableMapping[str, str] = os.environ,
           warn=None) -> Dict[str, str]:
    """Export Keras's and torchrun's variables for this rank into `environ`; returns them.

    Collective over MPI in a multi-host job or one started by ``mpirun`` / ``srun`` itself
    (every rank calls it, from mgpu_launcher.worker, before the program runs).

    Args:
        placement: this rank's place in the job.
        environ: the environment to add them to.
        warn: prints one line (rank 0 only); default: to stderr.
    """
    if placement.source == environments.TorchRun.name:
        return {}
    keras_given = KERAS_ADDRESSES in environ
    master_given = MASTER_ADDR in environ or MASTER_PORT in environ
    address = names = group = None
    if not (keras_given and master_given):
        try:
            address, names, group = coordinator(placement, environ)
        except NoAgreement as error:
            if placement.rank == 0:
                (warn or _warn)(
                    f"{error}: {KERAS_ADDRESSES}, {MASTER_ADDR} and {MASTER_PORT} are not set. "
                    f"A script that needs them: start it with srun --mpi=pmix, mpirun or "
                    f"mgpu-train -np N, or set {COORDINATOR_VARIABLE}=HOST:PORT of rank 0's host")
    exported = torchrun_variables(placement, None if master_given else address, group)
    interface = gloo_interface(address, group, environ)
    if interface:
        exported[GLOO_INTERFACE] = interface
    if address is not None and not keras_given:
        exported.update(keras_variables(placement, address, names))
        bind = jax_bind_address(address, environ)
        if bind:
            exported[JAX_BIND] = bind
    environ.update(exported)
    _exported.update(exported)
    return exported


def gloo_interface(address: Optional[str], group, environ: Mapping[str, str]) -> Optional[str]:
    """The interface gloo should bind in a job on several hosts (``GLOO_SOCKET_IFNAME``), or
    None: on one host, where it is set, or where no interface holds the address found.

    gloo binds this host's own name resolved, which Debian and Ubuntu map to 127.0.1.1: the
    other hosts then dial a loopback address (a DDP script's ``init_process_group("gloo")``
    fails to connect its mesh). The interface holding the address this host reaches the
    coordinator from is the one the others can dial, as mgpu's own torch engine chooses.
    """
    if address is None or group is None or group[1] < 2 or GLOO_INTERFACE in environ:
        return None
    from mgpu_launch.runtime import rendezvous
    host = address.rpartition(":")[0].strip("[]")
    return rendezvous.interface_toward(host)


def without_own(environ: Mapping[str, str]) -> Dict[str, str]:
    """`environ` less the variables :func:`export` set in this process (still unchanged): the
    environment for the ranks of a job this process starts, which get their own."""
    return {name: value for name, value in environ.items()
            if _exported.get(name, None) != value}


def export_jax_device(environ: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """``JAX_LOCAL_DEVICE_IDS`` = the GPU pinned to this JAX rank, after pinning; returns it.

    A JAX rank sees every GPU of its host (mgpu_launch.config.devices): without this, the
    ``jax.distributed.initialize()`` of a keras.distribution script would give every process
    all of them. JAX reads the variable when it is passed no ``local_device_ids`` (mgpu's own
    engine passes them). Set only where pinning left the GPUs visible and gave the rank one
    (``MGPU_LOCAL_DEVICE``), and not over a value already there. Not run on GPUs yet.

    Example:
        >>> export_jax_device({"MGPU_LOCAL_DEVICE": "1", "MGPU_GPU": "1",
        ...                    "CUDA_VISIBLE_DEVICES": "0,1"})
        '1'
    """
    device = settings.integer("MGPU_LOCAL_DEVICE", environ)
    narrowed = environ.get("CUDA_VISIBLE_DEVICES") == settings.text("MGPU_GPU", environ)
    if device is None or narrowed or JAX_DEVICES in environ:
        return None
    device = environ[JAX_DEVICES] = str(device)
    _exported[JAX_DEVICES] = device
    return device


def hint_for(error: BaseException, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """What to change when the program failed on something these variables decide, else None.

    Three failures have a cause the traceback does not show: a ``keras.distribution.initialize()``
    asked for another process count than the job's (Keras compares it with the addresses
    exported here), a device ``cuda:LOCAL_RANK`` that pinning hid, and JAX's CPU collectives
    (gloo) dialling another host's loopback address: they bind the address the host's own name
    resolves to, 127.0.1.1 where /etc/hosts maps it as Debian and Ubuntu do, and neither JAX
    nor gloo reads a variable that changes it (mgpu's own JAX engine passes the job's address).

    Example:
        >>> hint_for(RuntimeError("CUDA error: invalid device ordinal"), {"MGPU_GPU": "1",
        ...          "CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "1"})[:44]
        'mgpu-train pinned GPU 1 to this process as i'
    """
    text = str(error)
    size = environ.get(KERAS_NUM_PROCESSES)
    if size and "job_addresses" in text and "num_processes" in text:
        return (f"mgpu-train started this job with {size} processes and exported "
                f"{KERAS_ADDRESSES} for {size}: call keras.distribution.initialize() without "
                f"num_processes (it reads the job's), or start as many processes as the script "
                f"asks for (-np)")
    gpu = settings.text("MGPU_GPU", environ)
    if "invalid device ordinal" in text and gpu is not None and \
            environ.get("CUDA_VISIBLE_DEVICES") == gpu:
        return (f"mgpu-train pinned GPU {gpu} to this process as its only GPU, cuda:0 "
                f"(CUDA_VISIBLE_DEVICES={gpu}); a script that picks cuda:LOCAL_RANK "
                f"(LOCAL_RANK={environ.get(LOCAL_RANK)}) needs mgpu-train --no-pin, which "
                f"leaves every GPU visible, as torchrun does")
    if "Gloo" in text and "remote=[127." in text:
        return ("JAX's CPU collectives (gloo) bind the address the host's own name resolves "
                "to, and another host's resolved to a loopback address, which this one "
                "cannot dial: on every host, map its name (hostname) to its network address "
                "(/etc/hosts or DNS) instead of 127.0.1.1")
    return None


def _warn(text: str) -> None:
    print(f"mgpu-train: warning: {text}", file=sys.stderr, flush=True)
