"""Start the job under mpirun, relay its output rank by rank, and explain how it ended.

mpirun tags every line with the rank that wrote it; the supervisor shows rank 0's stdout and
every rank's stderr on the console as ``[rank] line`` (all ranks' stdout with
``--all-ranks-output``), writes one log per rank with ``--output-dir``, and keeps the last
lines of each rank's stderr. When the job fails it prints the root cause first: the first rank
that failed, its exit code or signal, and the tail of its traceback.

Ctrl-C or SIGTERM to ``mgpu-train`` is passed to mpirun (which stops every rank); whatever is
still alive after a grace period is killed. mpirun runs in a session of its own, and its ranks
stay in that session (Open MPI gives each rank its own process group, so killing mpirun's group
is not enough): at the end every process of the session is killed, and the supervisor waits
until none is left, so a restart never meets the previous attempt's ranks.
"""

import collections
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence, TextIO, Tuple

from mgpu_launcher import merge
from mgpu_launcher.mpirun import Flavour
from mgpu_launcher.worker import FAILURE_MARKER, PROGRESS_MARKER, RESIZE_MARKER, STALL_MARKER

TAIL_LINES = 20
GRACE_SECONDS = 5.0
_SIGNAL_DEATH = re.compile(r"rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)")
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


@dataclasses.dataclass
class Failure:
    rank: int
    reason: str
    stall: bool = False  # the stall inspector ended the job; `rank` is the late rank


@dataclasses.dataclass
class Outcome:
    """How one run of the job ended."""

    status: int  # mpirun's exit status; 128+N when mgpu-train was stopped by signal N
    stopped_by: Optional[int] = None  # the signal that stopped mgpu-train itself
    progressed: bool = False  # a rank finished a training step (worker.PROGRESS_MARKER)
    cause: Optional[Failure] = None  # the root cause of a failure, when known
    leftovers: Tuple[int, ...] = ()  # processes of the job still alive after the teardown
    resized: Optional[str] = None  # where an elastic job stopped to resize (RESIZE_MARKER)


class OutputRelay:
    """Routes tagged mpirun output lines to the console, per-rank logs and failure tracking."""

    def __init__(self, flavour: Flavour, all_ranks: bool, output_dir: Optional[str],
                 stdout: TextIO, stderr: TextIO, size: Optional[int] = None,
                 merge_window: Optional[float] = None):
        self.flavour, self.all_ranks, self.output_dir = flavour, all_ranks, output_dir
        # Identical stderr lines of several ranks once, tagged [0-3] (not with all_ranks).
        window = merge.DEFAULT_WINDOW if merge_window is None else merge_window
        self.merger = None if all_ranks or window <= 0 else merge.LineMerger(
            self._print_stderr, size=size, window=window)
        self.stdout, self.stderr = stdout, stderr
        self.tails: Dict[int, Deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.mpirun_lines: List[str] = []
        self.first_failure: Optional[Failure] = None
        self.progressed = False
        self.resized: Optional[str] = None
        self.logs: Dict[int, TextIO] = {}
        self.lock = threading.Lock()
        if output_dir:
            os.makedirs(output_dir, exist_ok=True)

    def _log(self, rank: int) -> TextIO:
        if rank not in self.logs:
            path = os.path.join(self.output_dir, f"rank.{rank}.log")
            self.logs[rank] = open(path, "w", buffering=1, encoding="utf-8")
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
            if self.output_dir:
                self._log(rank).write(text + "\n")
            if stream == "stderr":
                marked = _from_marker(text)
                if marked.startswith(PROGRESS_MARKER):
                    self.progressed = True
                    return  # for the supervisor only
                if marked.startswith(RESIZE_MARKER):
                    self.resized = marked[len(RESIZE_MARKER):].strip()
                    return  # the elastic loop reports it
                if not _START_UP_NOISE.match(marked):
                    self.tails[rank].append(marked)
                if self.first_failure is None:
                    self.first_failure = _failure_in(rank, marked)
            if stream == "stderr" and self.merger is not None:
                self.merger.line(rank, text)
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
        match = _SIGNAL_DEATH.search(" ".join(self.mpirun_lines))
        if match:
            number = int(match.group(2))
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            return Failure(int(match.group(1)), f"killed by signal {number} ({name})")
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
            lines.append("  root cause: unknown — no rank reported a failure; see mpirun's "
                         "messages above.")
            return "\n".join(lines)
        if cause.stall:
            lines.append(f"  root cause: the job stalled: {cause.reason}")
        else:
            lines.append(f"  root cause: rank {cause.rank} failed first: {cause.reason}")
        tail = [t for t in self.tails.get(cause.rank, ())
                if not t.startswith((FAILURE_MARKER, STALL_MARKER))]
        if tail:
            lines.append(f"  last lines of rank {cause.rank}'s stderr:")
            lines += [f"    {t}" for t in tail]
        return "\n".join(lines)

    def close(self) -> None:
        for log in self.logs.values():
            log.close()


_STALL_LINE = re.compile(r"^\[(\d+)\] (.*)$")


def _from_marker(text: str) -> str:
    """`text` from its first marker on: a marker line can arrive behind stray bytes.

    Seen in CI (1 in 20 raised faults): the rank's MPI_Abort banner and the marker shared a
    pipe, and the marker line came through with an undecodable byte in front of it.
    """
    for marker in (FAILURE_MARKER, STALL_MARKER, PROGRESS_MARKER, RESIZE_MARKER):
        at = text.find(marker)
        if at > 0:
            return text[at:]
    return text


def _failure_in(rank: int, text: str) -> Optional[Failure]:
    """The failure a rank's stderr line reports, if it is a marker line (see _from_marker)."""
    if text.startswith(FAILURE_MARKER):
        return Failure(rank, text[len(FAILURE_MARKER):].strip())
    if text.startswith(STALL_MARKER):
        rest = text[len(STALL_MARKER):].strip()
        match = _STALL_LINE.match(rest)
        if match:
            return Failure(int(match.group(1)), match.group(2), stall=True)
        return Failure(rank, rest, stall=True)
    return None


def session_members(session: int) -> List[int]:
    """Live processes (not zombies) of the session `session`, from /proc (empty elsewhere)."""
    members = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == session and fields[0] not in "ZX":
            members.append(int(entry))
    return members


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL mpirun's process group and every other process of its session (the ranks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_until_gone(session: int, timeout: float) -> Tuple[int, ...]:
    """Wait for the session's processes to die; returns those still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        alive = session_members(session)
        if not alive or time.monotonic() > deadline:
            return tuple(alive)
        time.sleep(0.05)


def supervise(command: Sequence[str], flavour: Flavour, *, all_ranks: bool = False,
              output_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None,
              stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
              attempt: Optional[Tuple[int, int]] = None, size: Optional[int] = None,
              merge_window: Optional[float] = None,
              on_start: Optional[Callable[[subprocess.Popen, "OutputRelay"], None]] = None
              ) -> Outcome:
    """Run `command` (an mpirun argument list) to its end and tear the job down completely.

    Args:
        command: the mpirun argument list.
        flavour: its MPI flavour (how it tags output lines).
        all_ranks: show every rank's stdout, not only rank 0's, and merge no stderr lines.
        output_dir: write each rank's output to ``output_dir/rank.N.log``.
        env: mpirun's environment.
        stdout, stderr: where the console output goes (default: sys.stdout / sys.stderr).
        attempt: (this attempt, attempts allowed), for the failure summary under restarts.
        size: the job's number of ranks (merged lines go out once every rank printed them).
        merge_window: seconds a stderr line waits for the same line from other ranks (0: no
            merging; default ``merge.DEFAULT_WINDOW``). Ignored with `all_ranks`.
        on_start: called with mpirun's Popen and the output relay once mpirun runs (the
            elastic loop signals the job through them).

    Returns:
        An :class:`Outcome`: its status is mpirun's exit status, 128+N when mgpu-train itself
        was stopped by signal N.
    """
    stderr = stderr or sys.stderr
    relay = OutputRelay(flavour, all_ranks, output_dir, stdout or sys.stdout, stderr,
                        size=size, merge_window=merge_window)
    # Its own session, so that on a second signal the whole tree can be killed at once.
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    pumps = [threading.Thread(target=relay.pump, args=(pipe, name), daemon=True)
             for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for pump in pumps:
        pump.start()
    if on_start is not None:
        on_start(proc, relay)
    finished = threading.Event()

    def ticker():
        while not finished.wait(0.2):
            relay.tick()

    threading.Thread(target=ticker, daemon=True).start()

    stopped_by: List[int] = []
    killer = threading.Timer(GRACE_SECONDS, _kill_group, args=(proc,))
    killer.daemon = True

    def forward(signum, _frame):
        if not stopped_by:
            stopped_by.append(signum)
            print(f"mgpu-train: got {signal.Signals(signum).name}, stopping every rank",
                  file=stderr, flush=True)
            proc.send_signal(signal.SIGTERM)
            killer.start()
        else:
            _kill_group(proc)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        killer.cancel()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _kill_group(proc)  # nothing of the job outlives mgpu-train
        leftovers = _wait_until_gone(proc.pid, GRACE_SECONDS)
        deadline = time.monotonic() + 5
        for pump in pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        finished.set()
        relay.flush()
        relay.close()
    if leftovers:
        print(f"mgpu-train: warning: processes of the job still alive after SIGKILL: "
              f"{', '.join(map(str, leftovers))}", file=stderr, flush=True)
    outcome = Outcome(status, progressed=relay.progressed, cause=relay.root_cause(),
                      leftovers=leftovers, resized=relay.resized)
    if stopped_by:
        outcome.status, outcome.stopped_by = 128 + stopped_by[0], stopped_by[0]
    elif status != 0:
        print(relay.summary(status, attempt), file=stderr, flush=True)
    return outcome
