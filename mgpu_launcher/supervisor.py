"""Start the job under mpirun, relay its output rank by rank, and explain how it ended.

mpirun tags every line with the rank that wrote it; the supervisor's output relay
(mgpu_launcher.relay) shows rank 0's stdout and every rank's stderr on the console as
``[rank] line`` (all ranks' stdout with ``--all-ranks-output``), writes one log per rank with
``--output-dir``, and keeps the last lines of each rank's stderr. When the job fails the
supervisor prints the root cause first: the first rank that failed, its exit code or signal,
and the tail of its traceback.

Ctrl-C or SIGTERM to ``mgpu-train`` is passed to mpirun (which stops every rank); whatever is
still alive after a grace period is killed. mpirun runs in a session of its own, and its ranks
stay in that session (mgpu_launcher.sessions): at the end every process of the session is
killed, and the supervisor waits until none is left, so a restart never meets the previous
attempt's ranks. Signals are forwarded only when the supervisor runs on the main thread
(``mgpu_launch.run`` may run on another). Whatever thread it runs on, a reaper process
(mgpu_launcher.sessions) ends the job if the launching process dies or exits before it, SIGKILL
included.
"""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, Iterator, Optional, Sequence, TextIO, Tuple

from mgpu_launcher import mpirun, sessions
from mgpu_launch.config import devices, markers
from mgpu_launcher.mpirun import Flavour
from mgpu_launcher.relay import Failure, OutputRelay


@dataclasses.dataclass
class Outcome:
    """How one run of the job ended."""

    status: int  # mpirun's exit status; 128+N when mgpu-train was stopped by signal N
    stopped_by: Optional[int] = None  # the signal that stopped mgpu-train itself
    progressed: bool = False  # a rank finished a training step (markers.PROGRESS_MARKER)
    cause: Optional[Failure] = None  # the root cause of a failure, when known
    leftovers: Tuple[int, ...] = ()  # processes of the job still alive after the teardown
    resized: Optional[str] = None  # where an elastic job stopped to resize (RESIZE_MARKER)
    backup: Optional[str] = None  # an elastic job's last backup point (BACKUP_MARKER), if any
    lost_hosts: Tuple[str, ...] = ()  # hosts mpirun lost or could not reach, as it names them


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
                        no_gpu=no_gpu_anywhere(command, env),
                        marker_key=(os.environ if env is None else env).get(markers.KEY_VARIABLE))
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
