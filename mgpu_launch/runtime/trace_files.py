"""The timeline's files: slices as Chrome / Perfetto trace events, written atomically, and the
merge of several files (the ``FILE.rank<N>.json`` dumps of a job that crashed or stalled).

    python3 -m mgpu_launch.runtime.trace_files merge job.json timeline.json.rank*.json

A trace is a JSON object whose ``traceEvents`` hold one process per rank (``pid`` = rank,
named ``rank N``), one thread track per recording thread and ``"X"`` (complete) events with
``ts``/``dur`` in microseconds. Times are rank 0's monotonic clock (see
``mgpu_launch.runtime.timeline``), so the dumps of several ranks line up once merged.
"""

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mgpu_launch.runtime import folders

#: the largest trace file ``merge`` reads (a rank's dump of a full recorder is ~20 MB)
MAX_BYTES = 1 << 30
#: the deepest JSON nesting ``merge`` reads (trace events nest 4 deep)
MAX_DEPTH = 32

#: the parent-phase field of a slice that had not ended when it was written (a dump)
OPEN = "(open)"

# (thread index, name, category, start ns, duration ns, step, parent phase name)
Slice = Tuple[int, str, str, int, int, int, str]


def trace_events(gathered: Sequence[Tuple[List[Slice], Dict[int, str]]], first_rank: int = 0,
                 base: Optional[int] = None) -> List[Dict[str, Any]]:
    """The trace events of every rank's (slices, thread names).

    Args:
        gathered: per rank, from `first_rank` on: its slices and its thread names by index.
        first_rank: the rank of ``gathered[0]``.
        base: the clock reading (ns) that becomes ts 0; default: the earliest slice's start.
            A rank's dump passes 0, so that dumps of several ranks share one time axis.

    Returns:
        The metadata events naming each rank and thread, then one ``"X"`` event per slice, in
        order of thread and start (a slice that had not ended has ``args.open``).
    """
    if base is None:
        base = min((s[3] for slices, _ in gathered for s in slices), default=0)
    events: List[Dict[str, Any]] = []
    for rank, (slices, threads) in enumerate(gathered, start=first_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for index, name in sorted(threads.items()):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": index,
                           "args": {"name": "training" if index == 0 else name}})
        for thread, name, category, start, duration, step, parent in sorted(
                slices, key=lambda s: (s[0], s[3], -s[4])):
            args: Dict[str, Any] = {"step": step}
            if parent == OPEN:
                args["open"] = True
            events.append({"name": name, "cat": category, "ph": "X", "pid": rank,
                           "tid": thread, "ts": (start - base) / 1000.0,
                           "dur": duration / 1000.0, "args": args})
    return events


def write_document(path: str, document: Dict[str, Any]) -> None:
    """Write `document` as JSON to `path` atomically, readable by this user only (0600).

    The folder passes ``folders.private_folder`` first (a missing one is made, mode 0700): a
    folder or a link of another user on the path would decide where the trace goes. The file
    is a new temporary one beside it, created with ``O_EXCL | O_NOFOLLOW`` and renamed over
    it, so a link at either name is replaced, never written through.

    Raises:
        mgpu_launch.runtime.folders.UnsafeFolder: (a PermissionError) another user could
            change the folder or its path; the message says which and how to fix it.
        OSError: the folder cannot be made or written in.
    """
    folder = folders.private_folder(os.path.dirname(os.path.abspath(path)), "the timeline's "
                                    "folder")
    folders.replace_file(os.path.join(folder, os.path.basename(path)),
                         json.dumps(document).encode(), mode=0o600)


def merge(paths: Sequence[str]) -> Dict[str, Any]:
    """One trace document of several trace files, their events side by side (each file's
    ranks and times kept as they are).

    Each file must be a regular file (no link, FIFO or device) of at most :data:`MAX_BYTES`,
    JSON nested at most :data:`MAX_DEPTH` deep: what another user left in a shared folder
    cannot make the merge block, run out of memory, or copy a file it reached through a link.

    Raises:
        OSError: a file cannot be read.
        ValueError: a file is not a trace-event JSON object with a ``traceEvents`` list, or is
            refused by the checks above (the message says which).

    Example:
        >>> merge(["t.json.rank0.json", "t.json.rank1.json"])["traceEvents"][0]["pid"]
        0
    """
    events: List[Dict[str, Any]] = []
    for path in paths:
        document = folders.load_json(folders.read_regular(path, MAX_BYTES, "the trace file"),
                                     path, MAX_DEPTH)
        if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
            raise ValueError(f"{path}: expected a trace-event JSON object with a "
                             f"'traceEvents' list (a timeline file of mgpu-launch)")
        events.extend(document["traceEvents"])
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "mgpu-launch", "merged from": list(paths)}}


USAGE = ("usage: python3 -m mgpu_launch.runtime.trace_files merge OUT FILE [FILE ...]\n"
         "  joins timeline files of one job (e.g. the FILE.rank<N>.json that the ranks of a "
         "crashed or stalled job wrote) into one trace OUT")


def main(argv: Optional[List[str]] = None) -> int:
    """The ``merge`` command; returns the exit code (2: a bad command line)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] != "merge":
        print(f"trace_files: got {' '.join(argv) or 'no arguments'}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        document = merge(argv[2:])
        write_document(os.path.abspath(argv[1]), document)
    except (OSError, ValueError) as error:
        print(f"trace_files merge: {error}", file=sys.stderr)
        return 1
    print(f"{argv[1]}: {len(document['traceEvents'])} events from {len(argv) - 2} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
