"""What every restart of a job shares, whether the hosts are fixed (``--max-restarts``) or
discovered (``--host-discovery-script``): the variables each attempt's ranks receive, and the
one decision not to restart a job that failed before its first training step.

Both loops (``mgpu_launcher.api.run_with_restarts`` and ``mgpu_launcher.elastic.run``) ask
here, so the rule and its message are written once.
"""

from typing import Optional

#: rank 0 prints worker.PROGRESS_MARKER after its first step: a failure after it is worth a
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
