"""``mgpu-bench --resume``: finish an invocation that was cut short, on the same machine.

A GPU session, a batch job or a shell can end before a long invocation does (32 ResNet-50 jobs
take longer than many allocations). mgpu-bench writes ``results.json`` after every job, with
the options that decide the jobs and their rows; ``--resume`` with the same ``--out`` then
reuses every job whose own result (``logs/<job>.json``) is there and runs the rest. Scaling
still compares only rows of that one invocation, so the rest must run on the same machine with
the same options: anything else is refused (exit 2), not mixed in.

Only results this user's own earlier call wrote are reused: ``results.json`` must be a regular
file of this user in the private ``--out`` folder (``runtime/folders.py``), its header must
carry that call's key (``invocation``) and the SHA-256 of each job's result file
(``results``), and a result file is reused only when its bytes have that digest and it passes
``result_file.read``'s checks. A file planted or changed by anyone else runs the job again.
"""

import os
import re
from typing import Optional, Tuple

from mgpu_launch.bench import result_file
from mgpu_launch.runtime import folders

#: options that change neither the jobs nor their rows
NOT_COMPARED = ("out", "resume", "timeout")
#: the largest results.json read back
MAX_BYTES = 64 << 20


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
        header = folders.load_json(folders.read_regular(path, MAX_BYTES, path, owned=True),
                                   path)["header"]
        if not isinstance(header, dict):
            raise TypeError("its header is not an object")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ResumeError(f"--resume: cannot read {path} ({error}); remove it or use another "
                          f"--out") from None
    before, digests = header.get("options"), header.get("results")
    if not isinstance(before, dict) or not isinstance(digests, dict) or not re.fullmatch(
            "[0-9a-f]{32}", str(header.get("invocation"))):
        raise ResumeError(f"--resume: {path} does not record its options, its call's key and "
                          f"its results' digests (an older mgpu-bench wrote it); run without "
                          f"--resume or use another --out")
    try:
        result_file.check_text(header.get("date"), f"{path} date")  # printed, and in the header
    except ValueError as error:
        raise ResumeError(f"--resume: {error}; remove it or use another --out") from None
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


def reusable(header: dict, label: str, result_path: str) -> Optional[Tuple[dict, str]]:
    """A finished job's result that the call of `header` recorded, checked; None when there
    is none to reuse (the job failed, was cut, or its file is not the one recorded: it runs
    again).

    Returns:
        (the result document, its SHA-256), as ``result_file.read``.
    """
    expected = header["results"].get(label)
    try:
        document, digest = result_file.read(result_path)
    except (OSError, ValueError):
        return None
    return (document, digest) if digest == expected else None
