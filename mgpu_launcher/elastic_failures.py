"""How an elastic job's failed attempt is told apart (mgpu_launcher.elastic's restart loop):
which host to blacklist, and whether the failure would only come back after a restart."""

import sys
from typing import Optional, Tuple

from mgpu_launcher import discovery
from mgpu_launcher.usage import PROG


def say(text: str) -> None:
    """Print an elastic-mode line on mgpu-train's stderr."""
    print(f"{PROG}: elastic: {text}", file=sys.stderr, flush=True)


def repeated(outcome, point: Optional[str]) -> Optional[Tuple[str, Optional[str]]]:
    """What identifies a failure that would come back the same after a restart, or None.

    Only an error the failing rank reported itself (an exception, an exit code: its
    ``markers.FAILURE_MARKER``), with the job's last backup point (where a restart resumes;
    None when the job reported none). Not a process killed by a signal or a stall: a host lost
    or a process killed from outside says nothing about the next attempt.

    Returns:
        ``(error text, backup point)``, or None.
    """
    if outcome.cause is None or outcome.cause.stall or killed(outcome):
        return None
    return outcome.cause.reason, point


def killed(outcome) -> bool:
    return bool(outcome.cause and outcome.cause.reason.startswith("killed by signal"))


def lost(hosts, blacklist: discovery.Blacklist) -> str:
    """Blacklist the hosts mpirun lost (their ranks' failures follow from it); the reason."""
    for host in hosts:
        seconds = blacklist.add(host)
        say(f"{host} failed: mpirun lost its daemon there, or could not start one over ssh; "
            f"{host} is blacklisted for {seconds:g} s (--blacklist-cooldown)")
    return f"{', '.join(hosts)} failed (mpirun lost {'them' if len(hosts) > 1 else 'it'})"


def failed(outcome, placed, blacklist: discovery.Blacklist) -> str:
    """Describe the failure, and blacklist the host of the rank that failed first."""
    cause = outcome.cause
    if cause is None or cause.stall:
        return (f"the job stalled: {cause.reason}" if cause
                else f"the job failed (exit status {outcome.status})")
    host = placed.host_of_rank(cause.rank)  # placed: the attempt's hostlists.HostSlots
    if host is None:
        return f"rank {cause.rank} failed: {cause.reason}"
    seconds = blacklist.add(host)
    say(f"{host} failed: rank {cause.rank} {cause.reason}; {host} is blacklisted for "
        f"{seconds:g} s (--blacklist-cooldown)")
    return f"{host} failed (rank {cause.rank}: {cause.reason})"
