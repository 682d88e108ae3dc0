"""Host lists: the one reader of text that names hosts and their slots, one host a line.

Two syntaxes reach mgpu-train, and both are read here:

- ``discovery``: what a host-discovery script prints (Horovod's ``--host-discovery-script``),
  ``HOST:SLOTS`` or ``HOST`` alone;
- ``hostfile``: an MPI hostfile (``--hostfile``, the MPI Operator's ``/etc/mpi/hostfile``),
  ``HOST [slots=N] [max_slots=N]`` or ``HOST`` alone.

Blank lines and ``#`` comments are skipped. Every host must be a host name
(:func:`is_host_name`: never an option, since hosts reach mpirun's ``-H``). What a caller does
with a line that does not parse differs: the discovery skips it with a warning
(``mgpu_launcher.discovery``), a hostfile is refused (``mgpu_launcher.hostfiles``).

What comes out, the hosts a job runs on, is one value, :class:`HostSlots`: read from ``-H``
by :func:`parse_hosts` (the command line and ``mgpu_launch.run``), made from a hostfile or a
discovery run, and written out once, by ``str()``, as mpirun's ``-H HOST:SLOTS,...``.
"""

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

# RFC 1123 host names (and the '_' some clusters' node names hold): dot-separated labels.
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_\-]{0,61}[A-Za-z0-9_])?$")
#: what a host name is, for messages
HOST_NAME = ("a host name: letters, digits, '-' and '_' in dot-separated labels of 1 to 63 "
             "characters, none starting or ending with '-'")
#: per syntax: the line's pattern (group 1 the host, group 2 what gives its slots)
_SYNTAXES = {
    "discovery": re.compile(r"^([^:\s]+)(?::(\d+))?$"),
    "hostfile": re.compile(r"^(\S+)((?:\s+(?:slots|max_slots|max-slots)\s*=\s*\d+)*)\s*$"),
}
_HOSTFILE_SLOTS = re.compile(r"(?:^|\s)slots\s*=\s*(\d+)")
#: one entry of -H: HOST or HOST:SLOTS
_HOST_ENTRY = re.compile(r"^([A-Za-z0-9_.\-]+)(?::(\d+))?$")


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """The hosts a job runs on, in mpirun's order, each with its slots.

    Attributes:
        entries: ``(host, slots)`` in order; slots None for a bare name (mpirun gives it one
            slot; the name reaches mpirun bare, as given).

    ``str()`` is the one writer of mpirun's ``-H`` value (``node1:2,node2``).

    Example:
        >>> hosts = parse_hosts("node1:2,node2")
        >>> str(hosts), hosts.total, hosts.host_of_rank(2)
        ('node1:2,node2', 3, 'node2')
    """

    entries: Tuple[Tuple[str, Optional[int]], ...]

    def __str__(self) -> str:
        return ",".join(host if slots is None else f"{host}:{slots}"
                        for host, slots in self.entries)

    def names(self) -> List[str]:
        return [host for host, _ in self.entries]

    def counts(self) -> List[Tuple[str, int]]:
        """``(host, slots)`` in order, a bare name counted as one slot."""
        return [(host, 1 if slots is None else slots) for host, slots in self.entries]

    def slots(self) -> Dict[str, int]:
        """host -> its slots (a host listed again: its last entry)."""
        return dict(self.counts())

    @property
    def total(self) -> int:
        return sum(count for _, count in self.counts())

    def host_of_rank(self, rank: int) -> Optional[str]:
        """The host rank `rank` runs on: ranks fill the hosts' slots in order (``--map-by
        slot``); None past the last slot."""
        for host, count in self.counts():
            if rank < count:
                return host
            rank -= count
        return None


def parse_hosts(text: str) -> HostSlots:
    """``HOST[:SLOTS],...`` as ``-H`` takes it (the one reader of that string).

    Raises:
        ValueError: an entry does not parse; the message names it and shows the form.
    """
    entries = []
    for entry in text.split(","):
        match = _HOST_ENTRY.match(entry)
        if match is None:
            raise ValueError(f"--hosts entry {entry!r} does not parse: expected HOST or "
                             f"HOST:SLOTS, comma-separated, e.g. -H node1:4,node2:4")
        entries.append((match.group(1), None if match.group(2) is None else int(match.group(2))))
    return HostSlots(tuple(entries))


@dataclasses.dataclass(frozen=True)
class Line:
    """One line that is not blank or a comment.

    Attributes:
        number: its line number (from 1).
        text: the line without its comment, stripped.
        host: the host it names; None when the line does not parse.
        slots: the slots it gives; None for a bare host name (the caller's default applies).
        is_host_name: whether `host` is a host name (:func:`is_host_name`).
    """

    number: int
    text: str
    host: Optional[str]
    slots: Optional[int]
    is_host_name: bool


def is_host_name(host: str) -> bool:
    """Whether `host` is a host name (never an option: no leading '-')."""
    return len(host) <= 253 and all(_LABEL.match(label) for label in host.split("."))


def lines(text: str, syntax: str) -> List[Line]:
    """Every line of `text` that is not blank or a comment, read in `syntax`.

    Args:
        text: the host list.
        syntax: ``"discovery"`` or ``"hostfile"`` (module docstring).

    Raises:
        ValueError: an unknown syntax.

    Example:
        >>> [(l.host, l.slots) for l in lines("a:2\\nb  # spare\\n", "discovery")]
        [('a', 2), ('b', None)]
    """
    if syntax not in _SYNTAXES:
        raise ValueError(f"syntax={syntax!r}: expected one of {sorted(_SYNTAXES)}")
    found = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _SYNTAXES[syntax].match(line)
        if match is None:
            found.append(Line(number, line, None, None, False))
            continue
        host, given = match.group(1), match.group(2)
        if syntax == "hostfile":
            given = _HOSTFILE_SLOTS.search(given)
            given = given.group(1) if given else None
        found.append(Line(number, line, host, None if given is None else int(given),
                          is_host_name(host)))
    return found
