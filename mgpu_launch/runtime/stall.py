"""Stall inspector: rank 0 notices when ranks stop meeting, says who and where, and may end the job.

A collective waits forever for a rank that never comes (MPI, NCCL, gloo and TensorFlow's ring
have no timeout), so one rank stuck in user code — a dead NFS read, a deadlocked loader, a
different code path — hangs the whole job silently. Like Horovod's stall inspector, every rank
records where it is in the training step protocol (:func:`mark`, called by the probes that
``mgpu_launch.training.stall_probes`` adds to ``fit``), and a side channel that does not need
the control plane (MPI) to be free carries that position to rank 0:

* rank 0 listens on a TCP port of the job's host address (``MGPU_STALL_PORT`` pins it; default
  any free port) and the transport shares the address once, at ``mgpu.init()``; a port it
  cannot listen on is the same error on every rank (mgpu_launch.runtime.agreement);
* every other rank connects, proves the job's key (mgpu_launch.runtime.auth: a connection that does
  not, or that sends anything malformed, is closed and changes nothing) and runs a daemon
  thread that sends its position when it changed, at most every :data:`REPORT_INTERVAL_S`
  seconds (one short signed line; mgpu_launch.runtime.stall_channel);
* rank 0's monitor thread compares the positions. When the ranks are at different places and no
  rank has moved for ``MGPU_STALL_WARNING_S`` seconds (default 60), it prints one warning::

      mgpu: stall: rank 1 has not entered step 6 for 60 s (last seen in on_train_batch_end of
      step 5); rank 0 is waiting in step 6's gradient allreduce

  and asks the late ranks to print their Python stacks (``faulthandler``) to their stderr.
  With ``MGPU_STALL_SHUTDOWN_S`` set, a stall that lasts that long ends the job (MPI_Abort)
  with that text as the root cause of ``mgpu-train``'s failure summary.

Ranks that are all at the same place (one long step, a long first compilation) are never a
stall. ``MGPU_STALL_INSPECTOR=0`` turns the inspector off (it must then be off on every rank).
Recording a position is one comparison and one tuple assignment; nothing else runs on the
training thread.
"""

import faulthandler
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from mgpu_launch.runtime import agreement, auth, rendezvous, stall_channel, timeline
from mgpu_launch.config import settings as declared
from mgpu_launch.config import markers

#: seconds between two position reports of a rank (and between two checks on rank 0)
REPORT_INTERVAL_S = 0.5

# Where a rank is, in the order it passes through step k (steps count from 1, per process,
# across fit calls): each phase is a step further than the one before.
STARTED = 0          # step 0 only: before the first training step
BATCH_BEGIN = 1      # in the on_train_batch_begin callbacks of step k
TRAIN_STEP = 2       # in step k's compiled train step (its gradient allreduce)
BATCH_END = 3        # in the on_train_batch_end callbacks of step k
AFTER_STEP = 4       # step k done: fetching the next batch
VALIDATION = 5       # validating after step k (end of an epoch)
EPOCH_END = 6        # in on_epoch_end after step k
FIT_END = 7          # fit returned after step k
FIT_BEGIN = 8        # in on_train_begin of a fit that starts after step k (its checks, restores)

Position = Tuple[int, int, str]  # (step, phase, detail: e.g. "epoch 2")

_position: Position = (0, STARTED, "")
_inspector = None  # the running Reporter or Monitor, if any


def mark(step: int, phase: int, detail: str = "") -> None:
    """Record that this rank reached `phase` of `step` (never moves backwards).

    Called from the training thread by the fit probes, and from Keras's callback thread when it
    dispatches batch-end callbacks asynchronously (JAX, torch); a late, older report is
    dropped. No lock, on purpose (this runs four times per step): two threads racing can at
    worst leave the older of two positions of the same moment until the next mark.
    """
    global _position
    current = _position
    if step > current[0] or (step == current[0] and phase >= current[1]):
        _position = (step, phase, detail)


def position() -> Position:
    """This rank's last recorded position."""
    return _position


def describe(where: Position) -> str:
    """A position in words, e.g. ``on_train_batch_end of step 5``."""
    step, phase, detail = where
    text = {
        STARTED: "the program before its first training step",
        BATCH_BEGIN: f"on_train_batch_begin of step {step}",
        TRAIN_STEP: f"step {step}'s train step",
        BATCH_END: f"on_train_batch_end of step {step}",
        AFTER_STEP: f"fetching the batch after step {step}",
        VALIDATION: f"validation after step {step}",
        EPOCH_END: f"on_epoch_end after step {step}",
        FIT_END: f"the program after fit (last step {step})",
        FIT_BEGIN: f"on_train_begin of fit (after step {step})" if step else
                   "on_train_begin of fit",
    }.get(phase, f"phase {phase} of step {step}")
    return f"{text} ({detail})" if detail else text


def _goal(where: Position) -> str:
    """What a late rank has not done yet, when others wait at `where`."""
    step, phase, _ = where
    if phase in (BATCH_BEGIN, TRAIN_STEP):
        return f"entered step {step}"
    return f"reached {describe(where)}"


def _waiting_in(where: Position) -> str:
    step, phase, _ = where
    if phase == TRAIN_STEP:
        return f"waiting in step {step}'s gradient allreduce"
    if phase in (EPOCH_END, FIT_BEGIN):  # where ranks meet in host collectives
        return f"waiting in {describe(where)}"
    return f"in {describe(where)}"


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def stall_report(positions: Dict[int, Position], seconds: float) -> Optional[Tuple[List[int], str]]:
    """The late ranks and the warning's text, or None when every rank is at the same place.

    Args:
        positions: rank -> its last position.
        seconds: how long no rank has moved.

    Returns:
        (late ranks, text), e.g. ``([1], "rank 1 has not entered step 6 for 60 s (last seen in
        on_train_batch_end of step 5); rank 0 is waiting in step 6's gradient allreduce")``.
    """
    keys = {rank: where[:2] for rank, where in positions.items()}
    if len(set(keys.values())) < 2:
        return None
    lowest, highest = min(keys.values()), max(keys.values())
    late = sorted(rank for rank, key in keys.items() if key == lowest)
    ahead = [rank for rank, key in keys.items() if key == highest]
    where_late = {describe(positions[rank]) for rank in late}
    verb = "has" if len(late) == 1 else "have"
    text = (f"{_ranks(late)} {verb} not {_goal(positions[ahead[0]])} for {seconds:.0f} s "
            f"(last seen in {'; '.join(sorted(where_late))})")
    groups: Dict[str, List[int]] = {}
    for rank in sorted(positions):
        if rank not in late:
            groups.setdefault(_waiting_in(positions[rank]), []).append(rank)
    for where, ranks in groups.items():
        text += f"; {_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} {where}"
    return late, text


def settings() -> Tuple[bool, Optional[float], Optional[float]]:
    """(enabled, warning seconds, shutdown seconds) from the environment.

    Raises:
        mgpu_launch.config.settings.SettingError: a variable does not parse (seconds: a number > 0
            or ``off``; the inspector: a flag).
    """
    return (declared.flag("MGPU_STALL_INSPECTOR"), declared.seconds("MGPU_STALL_WARNING_S"),
            declared.seconds("MGPU_STALL_SHUTDOWN_S"))


def port() -> int:
    """``MGPU_STALL_PORT``: the port rank 0 listens on (0, the default: any free port).

    Raises:
        mgpu_launch.config.settings.SettingError: it is not a port number.
    """
    return declared.integer("MGPU_STALL_PORT")


class Monitor(threading.Thread):
    """Rank 0's side: collects the positions, warns about a stall, and may end the job."""

    #: seconds after start-up when rank 0 warns about ranks that have not reached it
    JOIN_WARNING_S = 20.0

    def __init__(self, server: stall_channel.PositionServer, warning_s: float,
                 shutdown_s: Optional[float]):
        super().__init__(name="mgpu-stall-monitor", daemon=True)
        self.server = server
        self.warning_s, self.shutdown_s = warning_s, shutdown_s
        self.positions: Dict[int, Position] = {0: _position}
        self.stopped = threading.Event()
        self.warned_at: Optional[float] = None
        self.started, self.outside = time.monotonic(), []  # ranks warned about as outside

    def missing(self) -> List[int]:
        """The ranks that have never reached the inspector (they keep trying)."""
        return sorted(set(range(1, self.server.size)) - self.server.joined)

    def check_joined(self) -> None:
        """Warn once when ranks are still outside :data:`JOIN_WARNING_S` after start-up, and
        say so when they are all in after all: a rank out of the inspector is never silent."""
        missing = self.missing()
        if missing and not self.outside and \
                time.monotonic() - self.started >= self.JOIN_WARNING_S:
            self.outside = missing
            print(f"mgpu: warning: stall inspector: {_ranks(missing)} "
                  f"{'has' if len(missing) == 1 else 'have'} not reached rank 0's inspector "
                  f"(port {self.server.port}) in {self.JOIN_WARNING_S:g} s; a stall there "
                  f"would go unnoticed until {'it does' if len(missing) == 1 else 'they do'}. "
                  f"They keep trying. Connections from outside the job may be crowding the "
                  f"port (MGPU_STALL_PORT pinned?): see docs/security.md.",
                  file=sys.stderr, flush=True)
        elif self.outside and not missing:
            print(f"mgpu: stall inspector: {_ranks(self.outside)} reached it after all; every "
                  f"rank is inspected", file=sys.stderr, flush=True)
            self.outside = []

    def run(self) -> None:
        last_move = time.monotonic()
        try:
            while not self.stopped.is_set():
                received = self.server.poll(REPORT_INTERVAL_S)  # only authenticated ranks'
                received[0] = _position
                for rank, where in received.items():
                    if self.positions.get(rank) != where:
                        self.positions[rank] = where
                        last_move = time.monotonic()
                self.check_joined()
                self.check(time.monotonic() - last_move)
        except OSError as error:  # the listener itself failed
            if not self.stopped.is_set():
                print(f"mgpu: stall inspector stopped: {type(error).__name__}: {error}",
                      file=sys.stderr, flush=True)
        finally:
            self.server.close()

    def check(self, still_for: float) -> None:
        if still_for < self.warning_s and (self.shutdown_s is None or still_for < self.shutdown_s):
            if self.warned_at is not None:
                print(f"mgpu: stall: over, the ranks moved on after {self.warned_at:.0f} s "
                      f"or more", file=sys.stderr, flush=True)
                self.warned_at = None
            return
        report = stall_report(dict(self.positions), still_for)
        missing, seen = self.missing(), report is not None
        if report is None and missing and still_for >= self.warning_s:
            # Every rank in the inspector waits at one place: the ones outside may be stalled.
            where = describe(self.positions[0])
            report = missing, (f"no rank has moved for {still_for:.0f} s (the ranks in the "
                               f"inspector are all in {where}), and {_ranks(missing)} never "
                               f"reached the stall inspector: the stall may be there")
        if report is None:
            return
        late, text = report
        # Ends the job only for a stall it saw; an unseen rank is a warning (it may be busy).
        shutting_down = seen and self.shutdown_s is not None and still_for >= self.shutdown_s
        if self.warned_at is None:
            self.warned_at = still_for
            print(f"mgpu: stall: {text}", file=sys.stderr, flush=True)
            self.ask_for_stacks(late)
            if shutting_down:
                time.sleep(1.0)  # let the late ranks print their stacks before the abort
        if shutting_down:
            markers.abort_job(1, f"{text} (MGPU_STALL_SHUTDOWN_S={self.shutdown_s:g})",
                             marker=markers.STALL_MARKER, rank=late[0])

    def ask_for_stacks(self, ranks: List[int]) -> None:
        for rank in ranks:
            self.server.ask_for_stacks(rank)
        if 0 in ranks:
            print("mgpu: stall: rank 0's Python stacks:", file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        timeline.dump_own("stall")  # rank 0's, always: the others' positions are in it

    def stop(self) -> None:
        self.stopped.set()
        self.server.wake()
        if self.is_alive() and self is not threading.current_thread():
            self.join(2 * REPORT_INTERVAL_S)


def start(state) -> None:
    """Start the inspector of a multi-process job (runtime hook of ``mgpu.init()``).

    Collective: every rank calls it, after the transport is up and the job key is shared. Rank 0 listens
    on the job's host address (``MGPU_STALL_PORT``, else a free port); the other ranks connect
    and prove the job key (mgpu_launch.runtime.auth) from their reporter thread. A rank that
    cannot reach rank 0 says so once and keeps trying in the background (a flood of
    connections from outside the job only delays it); it never fails the job.

    Raises:
        ValueError: ``MGPU_STALL_WARNING_S`` / ``MGPU_STALL_SHUTDOWN_S`` are not numbers > 0,
            or ``MGPU_STALL_PORT`` is not a port number.
        RuntimeError: rank 0 cannot listen on ``MGPU_STALL_PORT`` (on every rank).
    """
    global _inspector, _position
    enabled, warning_s, shutdown_s = settings()
    if not enabled or state.size < 2 or _inspector is not None:
        return
    listen_port = port()  # on every rank: a bad value fails them all alike
    _position = (0, STARTED, "")
    host = rendezvous.job_host_address(state)  # collective; not 127.0.1.1 across hosts
    # collective, on every rank: a bad MGPU_BIND_ADDRESS fails them all; the ranks dial the
    # address bound (MGPU_BIND_ADDRESS=127.0.0.2 is reachable at 127.0.0.2 only)
    bound, dial = rendezvous.checked_bind(state, host)
    server = None

    def listen_on_rank_0() -> str:
        nonlocal server
        try:
            server = stall_channel.PositionServer(bound, listen_port, state.job_key, state.size)
        except OSError as error:  # the address, not the port, may be what is wrong
            advice = rendezvous.listen_problem(bound, error)
            if advice:
                raise ValueError(advice) from error
            raise
        return f"{dial}:{server.port}"

    address = agreement.decided_by_root(state.transport, listen_on_rank_0, {
        ValueError: lambda advice: RuntimeError(
            f"the stall inspector cannot listen on {bound}:{listen_port}: {advice}."),
        OSError: lambda why: RuntimeError(
            f"the stall inspector cannot listen on {bound}:{listen_port} "
            f"(MGPU_STALL_PORT={listen_port}): {why}. "
            f"Pick a port that is free on rank 0's host, or unset MGPU_STALL_PORT.")})
    if state.rank == 0:
        _inspector = Monitor(server, warning_s or float("inf"), shutdown_s)
    else:
        host, _, number = address.rpartition(":")
        rank, key = state.rank, state.job_key
        _inspector = stall_channel.Reporter(
            rank, lambda: auth.connect(host, int(number), key, rank, timeout=10), position,
            REPORT_INTERVAL_S, on_request=lambda: timeline.dump_own("stall"))
    _inspector.start()


def stop() -> None:
    """Stop this rank's inspector thread (runtime hook of ``mgpu.shutdown()``)."""
    global _inspector
    if _inspector is not None:
        _inspector.stop()
        _inspector = None


def active() -> bool:
    """Whether this rank's inspector runs (positions are then worth recording)."""
    return _inspector is not None
