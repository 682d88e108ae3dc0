"""The one restart loop of a job, whether its hosts are fixed (``--max-restarts``) or discovered
(``--host-discovery-script``), and what every restart shares: the variables each attempt's
ranks receive, and the one decision not to restart a job that failed before its first step.

:func:`run_attempts` starts an attempt, waits for its outcome, decides, and starts the next;
a :class:`Policy` says how the two modes differ (``FixedRestarts`` here, for
``mgpu_launcher.api.run_with_restarts``; ``mgpu_launcher.elastic.ElasticRestarts``). The
differences, each a hook or an attribute of the policy:

* starting an attempt (``start``): fixed runs the same mpirun command on the given hosts,
  with the attempt's variables only when restarts are allowed, and names the attempt
  ("attempt 2 of 4") in the failure summary; elastic waits for slots (none within
  ``--elastic-timeout``: the loop stops), places ``-H`` on the hosts left, builds the command
  again, always sets the variables and ``MGPU_ELASTIC=1``, and watches discovery meanwhile;
* the restart message (``start``, given why): fixed prints "restarting (K of N restarts
  used)", elastic "restarting with N processes on H";
* a failure (``failed``): fixed only describes it; elastic blacklists the failing rank's host
  or the hosts mpirun lost, and describes it in other words;
* excused failures before the first step (``excused``): none when fixed; a killed process or
  a lost host when elastic. The refusal names ``early_failure_hint`` when fixed, what failed
  when elastic;
* a failure that repeats identically (``repeated``): elastic stops, fixed restarts;
* a job ending with status 0 after a stop to resize (``resized``, ``max_resizes``): elastic
  restarts, at most 100 times; fixed: status 0 is success;
* the restarts used up (``quiet_when_used_up``): fixed returns the last status at once (its
  summary said "attempt N of N"); elastic first blacklists, refuses or stops on a repeat,
  then says it stops;
* the prefix of its lines (``say``): "mgpu-train:" or "mgpu-train: elastic:".

Kept alike for both: success, or mgpu-train itself stopped by a signal, ends the loop with the
attempt's status; attempt numbers in messages count from 1, ``MGPU_RESTART_COUNT`` from 0.
"""

import sys
from typing import Callable, Optional, Tuple

from mgpu_launcher.usage import PROG

#: rank 0 prints markers.PROGRESS_MARKER after its first step: a failure after it is worth a
#: restart (set in the job's environment whenever it may be restarted)
PROGRESS_VARIABLE = "MGPU_PROGRESS_MARKER"
#: which attempt the ranks belong to: 0 for the first, 1 after the first restart, ...
RESTART_VARIABLE = "MGPU_RESTART_COUNT"


def attempt_environment(env: dict, attempt: int) -> dict:
    """`env` with the variables of attempt number `attempt` (0: the first), in place.

    Example:
        >>> attempt_environment({}, 2)
        {'MGPU_PROGRESS_MARKER': '1', 'MGPU_RESTART_COUNT': '2'}
    """
    env.update({PROGRESS_VARIABLE: "1", RESTART_VARIABLE: str(attempt)})
    return env


def not_restarting(outcome, attempt: int, why: str, excused: bool = False) -> Optional[str]:
    """Why a failed attempt must not be restarted, or None when it may be.

    A failure before any rank finished a training step (a SyntaxError, an ImportError, a wrong
    path) would come back at every restart, unless `excused` (the elastic loop: a killed
    process or a lost host, which a restart elsewhere can cure).

    Args:
        outcome: the attempt's ``supervisor.Outcome``.
        attempt: its number, from 1, for the message.
        why: what failed, for the message.
    """
    if outcome.progressed or excused:
        return None
    return (f"not restarting: attempt {attempt} failed before its first training step was "
            f"done ({why}), so every restart would fail the same way. Fix the error above "
            f"and run again.")


class Policy:
    """How one mode of restarting differs (see the module docstring); the defaults are those
    of a mode that neither resizes, excuses, nor stops on a repeated failure."""

    max_restarts: int = 0  # restarts after failures allowed
    max_resizes: int = 0  # restarts after a stop to resize allowed
    quiet_when_used_up: bool = False
    early_failure_hint: Optional[str] = None  # said of a failure before the first step

    def say(self, text: str) -> None:
        print(f"{PROG}: {text}", file=sys.stderr, flush=True)

    def start(self, attempt: int, why: Optional[str]):
        """Run attempt number `attempt` (0: the first) to its end; `why` the previous one is
        restarted (None for the first). Returns its ``supervisor.Outcome``, or None when it
        could not start (the policy said why)."""
        raise NotImplementedError

    def failed(self, outcome) -> str:
        """What failed, in a few words; act on the failure (elastic: blacklist a host)."""
        raise NotImplementedError

    def excused(self, outcome) -> bool:
        """Whether a failure before the first training step may still be restarted."""
        return False

    def repeated(self, outcome, failures: int) -> Optional[str]:
        """Why the restarts stop because this failure repeats the last one, or None."""
        return None

    def resized(self, outcome) -> Optional[str]:
        """Why a job that ended with status 0 is started again with another size, or None
        when it simply succeeded."""
        return None


def run_attempts(policy: Policy) -> int:
    """Start the job, and start it again after a failure or a resize, as `policy` says;
    returns the last attempt's exit status (1 when no attempt could start).

    Every attempt is torn down completely before the next (the supervisor waits until no
    process of it is left). Not restarted: success, mgpu-train itself stopped by a signal, a
    failure before any rank finished a training step that the policy does not excuse (the same
    error would come back every time: :func:`not_restarting`), and a failure after the
    restarts allowed are used.
    """
    status, why = 1, None
    failures = resizes = 0
    for attempt in range(policy.max_restarts + policy.max_resizes + 1):
        outcome = policy.start(attempt, why)
        if outcome is None:
            return status or 1
        status = outcome.status
        if outcome.stopped_by is not None:
            return status
        if status == 0:
            why = policy.resized(outcome)
            if why is None:
                return 0
            resizes += 1
            if resizes > policy.max_resizes:
                policy.say(f"stopping: {resizes} resizes in this run is more than "
                           f"{policy.max_resizes}")
                return 1
            continue
        if policy.quiet_when_used_up and failures >= policy.max_restarts:
            return status
        why = policy.failed(outcome)
        refusal = not_restarting(outcome, attempt + 1, policy.early_failure_hint or why,
                                 excused=policy.excused(outcome))
        if refusal:
            policy.say(refusal)
            return status
        failures += 1
        stop = policy.repeated(outcome, failures)
        if stop:
            policy.say(stop)
            return status
        if failures > policy.max_restarts:
            policy.say(f"stopping: {why}, and the {policy.max_restarts} restarts allowed are "
                       f"used (--max-restarts)")
            return status
    return status


class FixedRestarts(Policy):
    """``--max-restarts N`` on the given hosts: the same job up to N more times.

    Args:
        max_restarts: restarts allowed.
        env: mpirun's environment, the attempt's variables set in it in place.
        supervise: ``supervise(attempt) -> supervisor.Outcome`` runs the job once;
            `attempt` is (this attempt, attempts allowed) for the failure summary, or None
            when no restart is allowed.
    """

    quiet_when_used_up = True
    early_failure_hint = "e.g. a SyntaxError, an ImportError or a bad argument"

    def __init__(self, max_restarts: int, env: dict,
                 supervise: Callable[[Optional[Tuple[int, int]]], object]):
        self.max_restarts, self.env, self.supervise = max_restarts, env, supervise

    def start(self, attempt: int, why: Optional[str]):
        if why is not None:
            self.say(f"restarting ({attempt} of {self.max_restarts} restarts used): attempt "
                     f"{attempt} failed ({why}); every process of it is gone.")
        attempts = self.max_restarts + 1
        if attempts > 1:
            attempt_environment(self.env, attempt)
        return self.supervise((attempt + 1, attempts) if attempts > 1 else None)

    def failed(self, outcome) -> str:
        cause = outcome.cause
        return (f"the job stalled: {cause.reason}" if cause and cause.stall else
                f"rank {cause.rank}: {cause.reason}" if cause else
                f"exit status {outcome.status}")
