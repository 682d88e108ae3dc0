"""Which hosts an elastic job may use now: a discovery script, and a blacklist with a cool-down.

The script is Horovod's (``horovodrun --host-discovery-script``): an executable that prints
the hosts available right now, one ``HOST:SLOTS`` per line (``HOST`` alone: one slot), and exits
0. mgpu-train runs it before every start of the job and every few seconds while it runs. What
it prints is checked here and nowhere else: a line that does not parse, or whose host is not a
host name (``-H`` must never receive an option), is skipped with a warning naming it; a script
that fails, hangs, or prints more than :data:`MAX_OUTPUT_BYTES` bytes or :data:`MAX_LINES`
lines, or nothing usable, is a :class:`DiscoveryError` with the reason. The script runs in a
process group of its own, ended when it runs past its time (a background job it started that
still holds its output included). Nothing it prints can crash the launcher or exhaust its
memory.

A host on which a rank failed is blacklisted for a cool-down (``--blacklist-cooldown``,
doubling with each further failure of that host, at most 16 times), as Horovod does; after it,
the host is used again if discovery still lists it.
"""

import dataclasses
import os
import selectors
import signal
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mgpu_launcher import hostlists

#: seconds the script may run before it counts as failed
SCRIPT_TIMEOUT_S = 30.0
#: the most the script may print on stdout, in bytes and in lines (a host list is far less)
MAX_OUTPUT_BYTES = 1 << 20
MAX_LINES = 65536
_MAX_BACKOFF = 16
_running = set()  # the discovery scripts running now (Popen), for end_all


class DiscoveryError(RuntimeError):
    """The discovery script failed or listed no usable host; the message says why."""


@dataclasses.dataclass(frozen=True)
class Hosts:
    """What one run of the discovery script found, in its order."""

    slots: Tuple[Tuple[str, int], ...]
    problems: Tuple[str, ...] = ()  # lines skipped, each with the reason

    @property
    def total(self) -> int:
        return sum(count for _, count in self.slots)

    def names(self) -> List[str]:
        return [host for host, _ in self.slots]

    def without(self, excluded: Sequence[str]) -> "Hosts":
        return Hosts(tuple((h, n) for h, n in self.slots if h not in excluded), self.problems)


def parse(text: str, source: str = "the discovery script", bare_slots: int = 1) -> Hosts:
    """Read ``HOST[:SLOTS]`` lines; blank lines and ``#`` comments are ignored.

    Args:
        bare_slots: the slots of a ``HOST`` line without ``:SLOTS`` (``--slots-per-host``: the
            MPI Operator's ``discover_hosts.sh`` prints bare names).

    Returns:
        The hosts with at least one slot, in order (a host listed twice: its first line), and
        a description of every line that was skipped.
    """
    slots: Dict[str, int] = {}
    problems = []
    for line in hostlists.lines(text, "discovery"):
        number, host = line.number, line.host
        if host is None:
            problems.append(f"{source}, line {number}: {line.text[:80]!r} skipped: expected "
                            f"HOST:SLOTS, e.g. node1:4")
            continue
        count = bare_slots if line.slots is None else line.slots
        if not line.is_host_name:
            problems.append(f"{source}, line {number}: {host[:80]!r} skipped: expected "
                            f"{hostlists.HOST_NAME}")
            continue
        if host in slots:
            problems.append(f"{source}, line {number}: {host} listed again; its first line "
                            f"counts")
        elif count > 0:
            slots[host] = count
    return Hosts(tuple(slots.items()), tuple(problems))


def discover(script: str, timeout: float = SCRIPT_TIMEOUT_S, bare_slots: int = 1) -> Hosts:
    """Run `script` and parse its output (`bare_slots`: see :func:`parse`).

    Raises:
        DiscoveryError: it could not be started, ran past `timeout` (its process group is then
            ended), exited non-zero, printed more than :data:`MAX_OUTPUT_BYTES` bytes or
            :data:`MAX_LINES` lines, or listed no host with a slot.
    """
    status, out, err = _run(script, timeout)
    if status != 0:
        last = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise DiscoveryError(f"{script} exited with status {status}"
                             + (f": {last[0][:200]}" if last[0] else ""))
    hosts = parse(out.decode("utf-8", "replace"), script, bare_slots)
    if not hosts.slots:
        why = f" ({'; '.join(hosts.problems)})" if hosts.problems else ""
        raise DiscoveryError(f"{script} listed no host with a slot{why}")
    return hosts


def _run(script: str, timeout: float) -> Tuple[int, bytes, bytes]:
    """(exit status, stdout, last bytes of stderr) of `script`, read within bounds.

    Raises:
        DiscoveryError: see :func:`discover`; the script's process group is ended first.
    """
    try:  # a session of its own: its group holds whatever it starts, background jobs too
        proc = subprocess.Popen([script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as error:
        raise DiscoveryError(f"{script} cannot be run: {error.strerror}") from None
    _running.add(proc)
    try:
        return _read(script, proc, timeout)
    except BaseException:  # Ctrl-C, mgpu-train's SIGTERM, a bug: no process of it is left
        _end(proc)
        raise
    finally:
        _running.discard(proc)


def _end(proc: subprocess.Popen) -> None:
    """End the script's whole process group (it outlives the script while one is left)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def end_all() -> None:
    """End every discovery script still running and what it started (mgpu-train calls it
    when it stops, whatever stopped it: a watcher thread's script would outlive it)."""
    for proc in list(_running):
        _end(proc)


def _read(script: str, proc: subprocess.Popen, timeout: float) -> Tuple[int, bytes, bytes]:
    out, err, lines, problem = bytearray(), bytearray(), 0, None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        while selector.get_map() and problem is None:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = _late(script, proc, timeout)
                break
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                elif key.fileobj is proc.stderr:
                    err += chunk
                    del err[:-4096]  # only its last line is shown
                else:
                    out += chunk
                    lines += chunk.count(b"\n")
                    if len(out) > MAX_OUTPUT_BYTES or lines > MAX_LINES:
                        limit = (f"{MAX_OUTPUT_BYTES} bytes" if len(out) > MAX_OUTPUT_BYTES
                                 else f"{MAX_LINES} lines")
                        problem = (f"{script} printed more than {limit}, the limit for a host "
                                   f"list (one HOST:SLOTS per line); its process group was "
                                   f"ended. Fix the script to print only the hosts")
                        break
    if problem is None:
        try:
            return proc.wait(max(0.0, deadline - time.monotonic())), bytes(out), bytes(err)
        except subprocess.TimeoutExpired:
            problem = _late(script, proc, timeout)
    _end(proc)
    raise DiscoveryError(problem)


def _late(script: str, proc: subprocess.Popen, timeout: float) -> str:
    if proc.poll() is None:
        return f"{script} did not finish in {timeout:g} s; its process group was ended"
    return (f"{script} exited (status {proc.returncode}), but a process it started kept its "
            f"output open for {timeout:g} s; its process group was ended. Fix: start background "
            f"jobs with their output redirected (cmd >/dev/null 2>&1 &)")


class Blacklist:
    """Hosts not to use for a while, because a rank failed there.

    Args:
        cooldown: seconds a host stays out after its first failure; each further failure
            doubles it (at most 16 x).
        clock: the time source (tests pass a fake one).
    """

    def __init__(self, cooldown: float, clock: Callable[[], float] = time.monotonic):
        self.cooldown, self.clock = cooldown, clock
        self.failures: Dict[str, int] = {}
        self.until: Dict[str, float] = {}

    def add(self, host: str) -> float:
        """Blacklist `host`; returns how many seconds it stays out."""
        self.failures[host] = self.failures.get(host, 0) + 1
        seconds = self.cooldown * min(2 ** (self.failures[host] - 1), _MAX_BACKOFF)
        self.until[host] = self.clock() + seconds
        return seconds

    def blocked(self) -> List[str]:
        """The hosts still cooling down."""
        now = self.clock()
        return [host for host, until in self.until.items() if until > now]


def place(hosts: Hosts, max_np: Optional[int]) -> Tuple[int, hostlists.HostSlots]:
    """How many processes to start on `hosts` and the hosts (with slots) for them.

    Slots are taken host by host in discovery order, up to `max_np` (None: all of them);
    Open MPI then places the ranks in that order (``--map-by slot``), so rank r runs on the
    host whose slots hold position r.
    """
    chosen, left = [], max_np if max_np is not None else hosts.total
    for host, count in hosts.slots:
        if left <= 0:
            break
        take = min(count, left)
        chosen.append((host, take))
        left -= take
    return sum(take for _, take in chosen), hostlists.HostSlots(tuple(chosen))


def hosts_named(names: Sequence[str], placed: hostlists.HostSlots) -> List[str]:
    """The hosts of `placed` (made by :func:`place`) that `names` (as mpirun printed them)
    refer to, each once, in the order of `names`.

    A name matches a host with the same name, or, when one of the two has no dot, the host
    whose first label it is: Open MPI 5 prints ``node2`` for ``node2.example.svc`` unless
    ``prte_keep_fqdn_hostnames`` is set. A name that matches several hosts matches none.

    Example:
        >>> hosts_named(["w1", "w1.job.svc"], hostlists.parse_hosts("w0.job.svc:2,w1.job.svc:2"))
        ['w1.job.svc']
    """
    hosts = placed.names()
    found: List[str] = []
    for name in names:
        matches = [host for host in hosts if host == name] or [
            host for host in hosts if ("." not in name or "." not in host)
            and host.split(".", 1)[0] == name.split(".", 1)[0]]
        if len(matches) == 1 and matches[0] not in found:
            found.append(matches[0])
    return found
