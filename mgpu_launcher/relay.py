"""The output of a running job: rank-tagged lines to the console and the per-rank logs, and what
they say about how the job ended.

mpirun tags every line with the rank that wrote it; :class:`OutputRelay` shows rank 0's stdout
and every rank's stderr on the console as ``[rank] line`` (all ranks' stdout with
``--all-ranks-output``), writes one log per rank with ``--output-dir``, and keeps the last lines
of each rank's stderr. It reads the markers the ranks print (mgpu_launcher.worker: a failure, a
stall, progress, a resize, a backup point) and mpirun's own words, and from them names the root
cause of a failure in the summary. mgpu_launcher.supervisor starts the job and relays its
output through it.
"""

import collections
import dataclasses
import io
import os
import re
import signal
import threading
from typing import Deque, Dict, List, Optional, TextIO, Tuple

from mgpu_launcher import merge
from mgpu_launch.config import settings
from mgpu_launch.runtime import folders
from mgpu_launcher.mpirun import Flavour
from mgpu_launch.config.markers import (BACKUP_MARKER, FAILURE_MARKER, PROGRESS_MARKER, RESIZE_MARKER,
                                  STALL_MARKER)

TAIL_LINES = 20
# Start-up notices every framework prints, which say nothing about a failure: kept out of the
# failure summary's "last lines" (glog INFO lines, absl's and TF's CPU notices).
_START_UP_NOISE = re.compile(
    r"^I\d{4} [\d:.]+\s+\d+ \S+\] |"
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR|"
    r"^To enable the following instructions: .* rebuild TensorFlow with the appropriate "
    r"compiler flags")
# mpirun's own refusals to start a job (no rank ran): (its words, the root cause to print).
_MPIRUN_REFUSALS = [
    (re.compile(r"There are not enough slots available in the system to satisfy the (\d+)\s+"
                r"slots"),
     "mpirun did not start the job: the hosts offer fewer slots than the {0} processes asked "
     "for (-H host:N gives a host N slots, a hostfile 'slots=N'; a host without :N has 1). "
     "Fix: give the hosts more slots, start fewer processes (-np), or allow more processes "
     "than slots with --mpirun-args='--oversubscribe'."),
]


def private_output_dir(path: str) -> str:
    """The real path of the per-rank log folder (``--output-dir``, the launcher API's
    `output_dir`), created with mode 0700 when missing.

    The rule of every folder a job writes (:func:`mgpu_launch.runtime.folders.private_folder`):
    a folder of this user that nobody else may write in, on a path nobody else may redirect (a
    link at the folder itself included); else nothing is written there.

    Raises:
        mgpu_launch.runtime.folders.UnsafeFolder: (a PermissionError) naming the folder, its
            owner or mode, and the fix.
        FileExistsError, NotADirectoryError: the path, or a part of it, is not a folder.
    """
    return folders.private_folder(path, "--output-dir")


@dataclasses.dataclass
class Failure:
    rank: int
    reason: str
    stall: bool = False  # the stall inspector ended the job; `rank` is the late rank


class OutputRelay:
    """Routes tagged mpirun output lines to the console, per-rank logs and failure tracking."""

    def __init__(self, flavour: Flavour, all_ranks: bool, output_dir: Optional[str],
                 stdout: TextIO, stderr: TextIO, size: Optional[int] = None,
                 merge_window: Optional[float] = None, no_gpu: bool = False,
                 marker_key: Optional[str] = None):
        self.flavour, self.all_ranks, self.output_dir = flavour, all_ranks, output_dir
        # the job's MGPU_MARKER_KEY: only lines carrying it are markers (see _marker_in)
        self.marker_key = marker_key
        # Identical stderr lines of several ranks once, tagged [0-3] (not with all_ranks), and
        # the frameworks' start-up chatter dropped or once (MGPU_STARTUP_NOISE=1: all of it);
        # no_gpu (see mgpu_launcher.supervisor.no_gpu_anywhere): TF's cuInit E-line is chatter too.
        window = merge.DEFAULT_WINDOW if merge_window is None else merge_window
        self.merger = None if all_ranks or window <= 0 else merge.LineMerger(
            self._print_stderr, size=size, window=window,
            quiet=not settings.flag("MGPU_STARTUP_NOISE"), no_gpu=no_gpu)
        self.stdout, self.stderr = stdout, stderr
        self.tails: Dict[int, Deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.mpirun_lines: List[str] = []
        self.first_failure: Optional[Failure] = None
        self.progressed = False
        self.resized: Optional[str] = None
        self.backup: Optional[str] = None
        self.logs: Dict[int, TextIO] = {}
        self.lock = threading.Lock()
        if output_dir:  # checked again at every attempt: the folder may change meanwhile
            self.output_dir = private_output_dir(output_dir)

    def _log(self, rank: int) -> TextIO:
        """Rank `rank`'s log, created anew (0600) in the private output folder.

        Whatever an earlier run left at the name (its log, a link) is removed first (unlink
        follows no link), then the file is created with ``O_EXCL | O_NOFOLLOW``: only this user
        can add entries to the folder (:func:`private_output_dir`), and should anything appear
        there meanwhile the create fails instead of writing through it.
        """
        if rank not in self.logs:
            path = os.path.join(self.output_dir, f"rank.{rank}.log")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self.logs[rank] = io.TextIOWrapper(folders.open_new(path), encoding="utf-8",
                                               line_buffering=True)
        return self.logs[rank]

    def line(self, raw: str, default_stream: str) -> None:
        """Handle one line that mpirun wrote to `default_stream` ("stdout" or "stderr")."""
        match = self.flavour.tag_pattern.match(raw)
        with self.lock:
            if match is None:  # mpirun's own words
                self.mpirun_lines.append(raw)
                print(raw, file=self.stderr, flush=True)
                return
            rank, stream, text = int(match.group(2) or match.group(1)), match.group(3), match.group(4)
            stream = stream or default_stream
            marked, text = _marker_in(text, self.marker_key) if stream == "stderr" else (None, text)
            if self.output_dir:
                self._log(rank).write(text + "\n")
            if marked is not None:  # a line of the job's own, for this launcher
                if marked.startswith(PROGRESS_MARKER):
                    self.progressed = True
                    return  # for the supervisor only
                if marked.startswith(RESIZE_MARKER):
                    self.resized = marked[len(RESIZE_MARKER):].strip()
                    return  # the elastic loop reports it
                if marked.startswith(BACKUP_MARKER):
                    self.backup = marked[len(BACKUP_MARKER):].strip()
                    return  # for the elastic loop only
                if self.first_failure is None:
                    self.first_failure = _failure_in(rank, marked)
            elif stream == "stderr" and not (
                    _START_UP_NOISE.match(text) or
                    self.merger is not None and self.merger.drops(text)):
                self.tails[rank].append(text)
            if stream == "stderr" and self.merger is not None:
                self.merger.line(rank, text)
            elif self.merger is not None and self.merger.drops(text):
                return  # start-up chatter some frameworks print on stdout (JAX's Gloo line)
            elif stream == "stderr" or rank == 0 or self.all_ranks:
                target = self.stderr if stream == "stderr" else self.stdout
                print(f"[{rank}] {text}", file=target, flush=True)

    def _print_stderr(self, tag: str, text: str) -> None:
        print(f"{tag} {text}", file=self.stderr, flush=True)

    def tick(self) -> None:
        """Print merged lines whose window has passed."""
        if self.merger is not None:
            with self.lock:
                self.merger.tick()

    def flush(self) -> None:
        if self.merger is not None:
            with self.lock:
                self.merger.flush()

    def pump(self, pipe, default_stream: str) -> None:
        for raw in iter(pipe.readline, b""):
            self.line(raw.decode("utf-8", "replace").rstrip("\r\n"), default_stream)

    def root_cause(self) -> Optional[Failure]:
        """The first failure: a rank that died by a signal (mpirun reports it), else the first
        marker a rank printed.

        A signal death comes first even when its report comes last: mpirun reports it only
        after the job ended, while the other ranks may already have failed *because* of it
        (TensorFlow's ring: "Connection reset by peer"). A stall the inspector reported is the
        cause of everything after it, so it is kept.
        """
        if self.first_failure and self.first_failure.stall:
            return self.first_failure
        death = self.flavour.signal_death_in(" ".join(self.mpirun_lines))
        if death:
            rank, number = death
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            return Failure(rank, f"killed by signal {number} ({name})")
        return self.first_failure

    def summary(self, status: int, attempt: Optional[Tuple[int, int]] = None) -> str:
        """The failure summary; `attempt` = (this attempt, attempts allowed) under restarts."""
        cause = self.root_cause()
        what = f"attempt {attempt[0]} of {attempt[1]}" if attempt else "the job"
        lines = [f"mgpu-train: {what} failed (exit status {status})."]
        if cause is None:
            said = " ".join(self.mpirun_lines)
            for pattern, text in _MPIRUN_REFUSALS:
                match = pattern.search(said)
                if match:
                    lines.append(f"  root cause: {text.format(*match.groups())}")
                    return "\n".join(lines)
            lost = self.flavour.lost_hosts_in(self.mpirun_lines)
            if lost:
                lines.append(f"  root cause: mpirun lost or could not reach {', '.join(lost)}: "
                             f"its daemon there ended or did not start (the host went away, or "
                             f"ssh to it failed); see mpirun's messages above.")
                return "\n".join(lines)
            lines.append(f"  root cause: no rank reported a failure (no Python exception, no "
                         f"stall): the job ended with exit status {status}, from a rank that "
                         f"exited so (sys.exit, os._exit) or crashed; see mpirun's messages "
                         f"above" + (" and the ranks' last lines:" if self.tails else "."))
            for rank in sorted(self.tails):
                lines.append(f"  last lines of rank {rank}'s stderr:")
                lines += [f"    {t}" for t in self.tails[rank]]
            return "\n".join(lines)
        if cause.stall:
            lines.append(f"  root cause: the job stalled: {cause.reason}")
        else:
            lines.append(f"  root cause: rank {cause.rank} failed first: {cause.reason}")
        tail = list(self.tails.get(cause.rank, ()))  # the marker lines are not in it
        if tail:
            lines.append(f"  last lines of rank {cause.rank}'s stderr:")
            lines += [f"    {t}" for t in tail]
        return "\n".join(lines)

    def close(self) -> None:
        for log in self.logs.values():
            log.close()


_STALL_LINE = re.compile(r"^\[(\d+)\] (.*)$")


_MARKERS = (FAILURE_MARKER, STALL_MARKER, PROGRESS_MARKER, RESIZE_MARKER, BACKUP_MARKER)


def _marker_in(text: str, key: Optional[str]) -> Tuple[Optional[str], str]:
    """(the marker line in `text` from its marker on, or None; `text` as shown and logged).

    With the job's key (``MGPU_MARKER_KEY``, mgpu-train sets it in every rank), a marker is
    ``KEY:`` followed by a marker, found anywhere in the line: a rank's own text cannot hold the
    key by accident, and a marker line can arrive behind stray bytes (seen in CI, 1 in 20
    raised faults: the rank's MPI_Abort banner and the marker shared a pipe, and the marker line
    came through with an undecodable byte in front of it). The key is left out of the line as
    shown. Without a key (a relay of no mgpu-train job), only a line that starts with a marker
    is one. Anything else that holds a marker string is the rank's text, shown as such.
    """
    if key:
        at = text.find(f"{key}:")
        rest = text[at + len(key) + 1:] if at >= 0 else ""
        if at >= 0 and rest.startswith(_MARKERS):
            return rest, text[:at] + rest
        return None, text
    return (text, text) if text.startswith(_MARKERS) else (None, text)


def _failure_in(rank: int, text: str) -> Optional[Failure]:
    """The failure a marker line (see :func:`_marker_in`) reports, if any."""
    if text.startswith(FAILURE_MARKER):
        return Failure(rank, text[len(FAILURE_MARKER):].strip())
    if text.startswith(STALL_MARKER):
        rest = text[len(STALL_MARKER):].strip()
        match = _STALL_LINE.match(rest)
        if match:
            return Failure(int(match.group(1)), match.group(2), stall=True)
        return Failure(rank, rest, stall=True)
    return None
