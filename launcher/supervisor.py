"""Start the job under mpirun, relay its output rank by rank, and explain how it ended.

mpirun tags every line with the rank that wrote it; the supervisor shows rank 0's stdout and
every rank's stderr on the console as ``[rank] line`` (all ranks' stdout with
``--all-ranks-output``), writes one log per rank with ``--output-dir``, and keeps the last
lines of each rank's stderr. When the job fails it prints the root cause first: the first rank
that failed, its exit code or signal, and the tail of its traceback.

Ctrl-C or SIGTERM to ``mgpu-train`` is passed to mpirun (which stops every rank); whatever is
still alive after a grace period is killed with its whole process group.
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
from typing import Deque, Dict, List, Optional, Sequence, TextIO

from mgpu_launcher.mpirun import Flavour
from mgpu_launcher.worker import FAILURE_MARKER

TAIL_LINES = 20
GRACE_SECONDS = 5.0
_SIGNAL_DEATH = re.compile(r"rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)")


@dataclasses.dataclass
class Failure:
    rank: int
    reason: str


class OutputRelay:
    """Routes tagged mpirun output lines to the console, per-rank logs and failure tracking."""

    def __init__(self, flavour: Flavour, all_ranks: bool, output_dir: Optional[str],
                 stdout: TextIO, stderr: TextIO):
        self.flavour, self.all_ranks, self.output_dir = flavour, all_ranks, output_dir
        self.stdout, self.stderr = stdout, stderr
        self.tails: Dict[int, Deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self.mpirun_lines: List[str] = []
        self.first_failure: Optional[Failure] = None
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
                self.tails[rank].append(text)
                if text.startswith(FAILURE_MARKER) and self.first_failure is None:
                    self.first_failure = Failure(rank, text[len(FAILURE_MARKER):].strip())
            if stream == "stderr" or rank == 0 or self.all_ranks:
                target = self.stderr if stream == "stderr" else self.stdout
                print(f"[{rank}] {text}", file=target, flush=True)

    def pump(self, pipe, default_stream: str) -> None:
        for raw in iter(pipe.readline, b""):
            self.line(raw.decode("utf-8", "replace").rstrip("\r\n"), default_stream)

    def root_cause(self) -> Optional[Failure]:
        """The first failure: a rank's own marker, else a signal death mpirun reported."""
        if self.first_failure:
            return self.first_failure
        match = _SIGNAL_DEATH.search(" ".join(self.mpirun_lines))
        if match:
            number = int(match.group(2))
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            return Failure(int(match.group(1)), f"killed by signal {number} ({name})")
        return None

    def summary(self, status: int) -> str:
        cause = self.root_cause()
        lines = [f"mgpu-train: the job failed (exit status {status})."]
        if cause is None:
            lines.append("  root cause: unknown — no rank reported a failure; see mpirun's "
                         "messages above.")
            return "\n".join(lines)
        lines.append(f"  root cause: rank {cause.rank} failed first: {cause.reason}")
        tail = [t for t in self.tails.get(cause.rank, ()) if not t.startswith(FAILURE_MARKER)]
        if tail:
            lines.append(f"  last lines of rank {cause.rank}'s stderr:")
            lines += [f"    {t}" for t in tail]
        return "\n".join(lines)

    def close(self) -> None:
        for log in self.logs.values():
            log.close()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def supervise(command: Sequence[str], flavour: Flavour, *, all_ranks: bool = False,
              output_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None,
              stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    """Run `command` (an mpirun argument list) to its end; return the job's exit status.

    Returns mpirun's exit status; 128+N when mgpu-train itself was stopped by signal N.
    """
    relay = OutputRelay(flavour, all_ranks, output_dir, stdout, stderr)
    # Its own session, so that on a second signal the whole tree can be killed at once.
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    pumps = [threading.Thread(target=relay.pump, args=(pipe, name), daemon=True)
             for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
    for pump in pumps:
        pump.start()

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
        deadline = time.monotonic() + 5
        for pump in pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        relay.close()
    if stopped_by:
        return 128 + stopped_by[0]
    if status != 0:
        print(relay.summary(status), file=stderr, flush=True)
    return status
