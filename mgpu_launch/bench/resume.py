"""``mgpu-bench --resume``: finish an invocation that was cut short, on the same machine.

A GPU session, a batch job or a shell can end before a long invocation does (32 ResNet-50 jobs
take longer than many allocations). mgpu-bench writes ``results.json`` after every job, with
the options that decide the jobs and their rows; ``--resume`` with the same ``--out`` then
reuses every job whose own result (``logs/<job>.json``) is there and runs the rest. Scaling
still compares only rows of that one invocation, so the rest must run on the same machine with
the same options: anything else is refused (exit 2), not mixed in.
"""

import json
import os
from typing import Optional

from mgpu_launch.bench import report

#: options that change neither the jobs nor their rows
NOT_COMPARED = ("out", "resume", "timeout")


class ResumeError(ValueError):
    """``--out`` holds results that ``--resume`` must not continue."""


def previous_header(out: str, options: dict, machine: str, gpus) -> Optional[dict]:
    """The header of the invocation in `out` that ``--resume`` continues.

    Args:
        out: the ``--out`` folder.
        options: this invocation's options (``parse_args``'s ``args.options``).
        machine: this host's name; gpus: its GPU names (None on CPU).

    Returns:
        The header of ``out/results.json``; None when there is none (nothing to resume: every
        job runs).

    Raises:
        ResumeError: the file is unreadable, or was written by other options, on another
            machine or by an mgpu-bench that did not record its options.
    """
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        return None
    try:
        header = report.load(path)["header"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ResumeError(f"--resume: cannot read {path} ({error}); remove it or use another "
                          f"--out") from None
    before = header.get("options")
    if before is None:
        raise ResumeError(f"--resume: {path} does not record its options (an older "
                          f"mgpu-bench wrote it); run without --resume or use another --out")
    changed = sorted(key for key in set(before) | set(options)
                     if before.get(key) != options.get(key))
    if changed:
        shown = ", ".join(f"{key}: {before.get(key)!r} there, {options.get(key)!r} now"
                          for key in changed)
        raise ResumeError(f"--resume: {path} holds the results of other options ({shown}); "
                          f"repeat that command with --resume, or use another --out")
    if (header.get("machine"), header.get("gpus")) != (machine, gpus):
        raise ResumeError(
            f"--resume: {path} was measured on {header.get('machine')} "
            f"({header.get('gpus') or 'CPU'}), this is {machine} ({gpus or 'CPU'}); scaling "
            f"compares runs of one machine only: use another --out")
    return header


def finished(result_path: str) -> bool:
    """Whether a job's own result file is there and readable (it is written when the job
    ends; a job that failed or was cut has none)."""
    try:
        with open(result_path) as f:
            return bool(json.load(f).get("rows"))
    except (OSError, ValueError, AttributeError):
        return False
