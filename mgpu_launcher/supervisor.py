"""Start the job under mpirun, relay its output rank by rank, and explain how it ended.

mpirun tags every line with the rank that wrote it; the supervisor shows rank 0's stdout and
every rank's stderr on the console as ``[rank] line`` (all ranks' stdout with
``--all-ranks-output``), writes one log per rank with ``--output-dir``, and keeps the last
lines of each rank's stderr. When the job fails it prints the root cause first: the first rank
that failed, its exit code or signal, and the tail of its traceback.

Ctrl-C or SIGTERM to ``mgpu-train`` is passed to mpirun (which stops every rank); whatever is
still alive after a grace period is killed. mpirun runs in a session of its own, and its ranks
stay in that session (mgpu_launcher.sessions): at the end every process of the session is
killed, and the supervisor waits until none is left, so a restart never meets the previous
attempt's ranks. Signals are forwarded only when the supervisor runs on the main thread
(``mgpu_launch.run`` may run on another). Whatever thread it runs on, a reaper process
(mgpu_launcher.sessions) ends the job if the launching process dies or exits before it, SIGKILL
included.
"""

import collections
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Deque, Dict, Iterator, List, Optional, Sequence, TextIO, Tuple

from mgpu_launcher import devices, merge, mpirun, sessions, settings
from mgpu_launcher.mpirun import Flavour
from mgpu_launcher.worker import (BACKUP_MARKER, FAILURE_MARKER, PROGRESS_MARKER, RESIZE_MARKER,
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
    backup: Optional[str] = None  # an elastic job's last backup point (BACKUP_MARKER), if any
    lost_hosts: Tuple[str, ...] = ()  # hosts mpirun lost or could not reach, as it names them


class OutputRelay:
    """Routes tagged mpirun output lines to the console, per-rank logs and failure tracking."""

    def __init__(self, flavour: Flavour, all_ranks: bool, output_dir: Optional[str],
                 stdout: TextIO, stderr: TextIO, size: Optional[int] = None,
                 merge_window: Optional[float] = None, no_gpu: bool = False):
        self.flavour, self.all_ranks, self.output_dir = flavour, all_ranks, output_dir
        # Identical stderr lines of several ranks once, tagged [0-3] (not with all_ranks), and
        # the frameworks' start-up chatter dropped or once (MGPU_STARTUP_NOISE=1: all of it);
        # no_gpu (see no_gpu_anywhere): TF's cuInit E-line is chatter too.
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
                if marked.startswith(BACKUP_MARKER):
                    self.backup = marked[len(BACKUP_MARKER):].strip()
                    return  # for the elastic loop only
                if not (_START_UP_NOISE.match(marked) or
                        self.merger is not None and self.merger.drops(marked)):
                    self.tails[rank].append(marked)
                if self.first_failure is None:
                    self.first_failure = _failure_in(rank, marked)
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
            lines.append(f"  root cause: mpirun lost or could not reach {', '.join(lost)}: its "
                         f"daemon there ended or did not start (the host went away, or ssh to "
                         f"it failed); see mpirun's messages above." if lost else
                         "  root cause: unknown — no rank reported a failure; see mpirun's "
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
    for marker in (FAILURE_MARKER, STALL_MARKER, PROGRESS_MARKER, RESIZE_MARKER, BACKUP_MARKER):
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


def _on_main_thread() -> bool:
    """Whether this code may install signal handlers (Python allows it on the main thread only)."""
    return threading.current_thread() is threading.main_thread()


class Job:
    """One run of mpirun, in three steps: :meth:`start`, :meth:`forward` (the signal handler
    that :meth:`signals_forwarded` installs) and :meth:`teardown`. :func:`supervise` strings
    them together.

    Attributes:
        proc: mpirun's Popen; its pid is also the job's session id.
        relay: the :class:`OutputRelay` its output goes through.
        stopped_by: the signal that stopped the job through :meth:`forward`, else None.
    """

    def __init__(self, proc: subprocess.Popen, relay: OutputRelay, stderr: TextIO,
                 reaper: Optional[sessions.Reaper]):
        self.proc, self.relay, self.stderr, self._reaper = proc, relay, stderr, reaper
        self.stopped_by: Optional[int] = None
        self._pumps = [threading.Thread(target=relay.pump, args=(pipe, name), daemon=True)
                       for pipe, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))]
        self._finished = threading.Event()
        self._killer = threading.Timer(sessions.GRACE_SECONDS, sessions.kill, args=(proc.pid,))
        self._killer.daemon = True

    @classmethod
    def start(cls, command: Sequence[str], env: Optional[Dict[str, str]], relay: OutputRelay,
              stderr: TextIO, run_folder: Optional[str] = None) -> "Job":
        """Start mpirun in a session of its own and relay its output.

        Its own session, so that the whole tree can be killed at once. A
        :class:`sessions.Reaper` ends the job (and removes `run_folder`) should this process
        die before it: a signal handler cannot catch SIGKILL, and off the main thread none can
        be installed at all (see :meth:`signals_forwarded`).
        """
        proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            reaper = sessions.Reaper(proc.pid, run_folder)
        except BaseException:
            sessions.kill(proc.pid)
            raise
        job = cls(proc, relay, stderr, reaper)
        for pump in job._pumps:
            pump.start()
        threading.Thread(target=job._tick, daemon=True).start()
        return job

    def _tick(self) -> None:
        while not self._finished.wait(0.2):
            self.relay.tick()  # merged lines whose window has passed

    def forward(self, signum: int, _frame=None) -> None:
        """A SIGINT or SIGTERM to the launcher: the first asks mpirun to stop every rank (and
        kills what is left after ``sessions.GRACE_SECONDS``), a second kills the job now."""
        if self.stopped_by is None:
            self.stopped_by = signum
            print(f"mgpu-train: got {signal.Signals(signum).name}, stopping every rank",
                  file=self.stderr, flush=True)
            self.proc.send_signal(signal.SIGTERM)
            self._killer.start()
        else:
            sessions.kill(self.proc.pid)

    @contextlib.contextmanager
    def signals_forwarded(self) -> Iterator[None]:
        """SIGINT and SIGTERM go to :meth:`forward` meanwhile, on the main thread only.

        Elsewhere (``mgpu_launch.run`` on a thread of its caller) Python runs signal handlers
        on the main thread alone: the caller's own handling applies there. Everywhere, the
        job's reaper ends the job if the caller dies or exits while it runs.
        """
        if not _on_main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def teardown(self) -> Tuple[int, ...]:
        """Kill every process of the job that is left and wait until none is, so a restart
        never meets this attempt's ranks; then drain and close its output.

        Returns:
            The processes still alive after that (normally none; a warning names them).
        """
        self._killer.cancel()
        sessions.kill(self.proc.pid)  # nothing of the job outlives mgpu-train
        leftovers = sessions.wait_until_gone(self.proc.pid, sessions.GRACE_SECONDS)
        deadline = time.monotonic() + 5
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))
        self._finished.set()
        self.relay.flush()
        self.relay.close()
        if self._reaper is not None:
            self._reaper.release()
        if leftovers:
            print(f"mgpu-train: warning: processes of the job still alive after SIGKILL: "
                  f"{', '.join(map(str, leftovers))}", file=self.stderr, flush=True)
        return leftovers


def no_gpu_anywhere(command: Sequence[str], environ: Optional[Dict[str, str]] = None) -> bool:
    """Whether every rank of `command` (an mpirun argument list) runs on this host and this
    host shows the ranks no GPU (devices.visible_gpus of their environment).

    False whenever in doubt (hosts named, a multi-host allocation, see mpirun.one_host): a rank
    elsewhere may have a GPU, where TensorFlow's ``failed call to cuInit`` line is a real error.
    """
    environ = os.environ if environ is None else environ
    return mpirun.one_host(None, None, command[1:], environ) and not devices.visible_gpus(environ)


def supervise(command: Sequence[str], flavour: Flavour, *, all_ranks: bool = False,
              output_dir: Optional[str] = None, env: Optional[Dict[str, str]] = None,
              stdout: Optional[TextIO] = None, stderr: Optional[TextIO] = None,
              attempt: Optional[Tuple[int, int]] = None, size: Optional[int] = None,
              merge_window: Optional[float] = None,
              on_start: Optional[Callable[[subprocess.Popen, "OutputRelay"], None]] = None,
              run_folder: Optional[str] = None) -> Outcome:
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
        run_folder: a temporary folder of the run that the reaper removes should this process
            die before the job ends (``mgpu_launch.run``'s); the caller removes it otherwise.

    Returns:
        An :class:`Outcome`: its status is mpirun's exit status, 128+N when the launcher itself
        was stopped by signal N (forwarded on the main thread only, see
        :meth:`Job.signals_forwarded`).
    """
    stderr = stderr or sys.stderr
    relay = OutputRelay(flavour, all_ranks, output_dir, stdout or sys.stdout, stderr,
                        size=size, merge_window=merge_window,
                        no_gpu=no_gpu_anywhere(command, env))
    job = Job.start(command, env, relay, stderr, run_folder)
    try:
        if on_start is not None:
            on_start(job.proc, relay)
        with job.signals_forwarded():
            status = job.proc.wait()
    finally:
        leftovers = job.teardown()
    lost = tuple(flavour.lost_hosts_in(relay.mpirun_lines))
    if status == 0 and lost and job.stopped_by is None:
        # prterun 5.0.11 said "PRTE has lost communication with a remote daemon ... will
        # terminate the job" and exited 0 (a deleted MPI Operator worker pod): not a success.
        status = 1
    outcome = Outcome(status, progressed=relay.progressed, cause=relay.root_cause(),
                      leftovers=leftovers, resized=relay.resized, backup=relay.backup,
                      lost_hosts=lost)
    if job.stopped_by is not None:
        outcome.status, outcome.stopped_by = 128 + job.stopped_by, job.stopped_by
    elif status != 0:
        print(relay.summary(status, attempt), file=stderr, flush=True)
    return outcome
