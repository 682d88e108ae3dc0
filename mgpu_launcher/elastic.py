"""``mgpu-train --host-discovery-script``: keep training while hosts come and go.

    mgpu-train -np 4 --min-np 2 --max-np 4 --host-discovery-script ./discover.sh train.py

Restart-based, like torchrun (a membership change restarts every rank; the program resumes
from its ``callbacks.BackupAndRestore`` backup), with Horovod's knobs and discovery format
(mgpu_launcher.discovery). The loop (mgpu_launcher.restarts's, with :class:`ElasticRestarts`),
each step printed once on mgpu-train's stderr:

1. Run the discovery script until the hosts it lists, minus blacklisted ones, offer at least
   ``--min-np`` slots (at most ``--elastic-timeout`` seconds; then stop with a message).
2. Start the job on them (``-H``, host by host, up to ``--max-np`` processes) with
   ``MGPU_ELASTIC=1`` in every rank, and poll discovery every ``MGPU_DISCOVERY_INTERVAL``
   seconds while it runs.
3. When discovery offers more slots (up to ``--max-np``), or a host of the job leaves the list
   or offers fewer slots than the processes the job runs there (Horovod: a removal of those
   slots), send mpirun SIGUSR1 (forwarded to every rank): at its next backup point the job
   writes a backup and every rank exits (mgpu_launch.training.resize); go to 1.
4. When a rank fails, the job is torn down (mgpu_launcher.supervisor, which prints the root
   cause: the failing rank's error and the last lines of its stderr); the host of the rank
   that failed first is blacklisted for ``--blacklist-cooldown`` seconds (doubling with each
   further failure); so is every host whose daemon mpirun lost or could not start over ssh (a
   machine gone, a deleted MPI Operator worker pod: its ranks fail or are ended by mpirun
   without a rank to blame), and then those hosts, not a rank, are the failure. Go to 1, at
   most ``--max-restarts`` times (default 10 here). A failure before the first training step
   that is neither a killed process nor a lost host (a SyntaxError, a bad argument) is not
   restarted; nor is one that repeats the attempt before it identically (the same error from
   a rank, and the same last backup point: rank 0 reports each with
   ``markers.BACKUP_MARKER``), unless ``MGPU_STOP_REPEATED_FAILURE=0``.
5. The job ending with status 0 without such a stop ends mgpu-train with 0.
"""

import dataclasses
import os
import shlex
import signal
import threading
import time
from typing import Callable, Optional, Set

from mgpu_launcher import discovery, elastic_failures, hostlists, restarts, supervisor
from mgpu_launch.config import settings
from mgpu_launcher.elastic_failures import say
from mgpu_launch.config.markers import ELASTIC_VARIABLE, RESIZE_SIGNAL

DEFAULT_TIMEOUT_S = settings.SETTINGS["MGPU_ELASTIC_TIMEOUT"].default
DEFAULT_COOLDOWN_S = settings.SETTINGS["MGPU_BLACKLIST_COOLDOWN"].default
DEFAULT_MAX_RESTARTS = 10
#: resizes (stops asked by mgpu-train) one invocation may make, a bound on the loop
MAX_RESIZES = 100


@dataclasses.dataclass(frozen=True)
class Options:
    """The elastic part of an mgpu-train command line (validated)."""

    script: str
    min_np: int
    max_np: Optional[int]  # None: as many as discovery offers
    timeout: float = DEFAULT_TIMEOUT_S
    cooldown: float = DEFAULT_COOLDOWN_S
    bare_slots: int = 1  # slots of a host printed without :SLOTS (--slots-per-host)
    stop_repeated: bool = True  # MGPU_STOP_REPEATED_FAILURE: see run()


def _number(value: str, source: str, convert, least, example: str):
    try:
        number = convert(value)
    except ValueError:
        number = None
    if number is None or number < least:
        raise ValueError(f"{source} {value!r}: expected a number >= {least}, e.g. {example}")
    return number


def options_from(np: int, min_np: Optional[str], max_np: Optional[str], script: Optional[str],
                 timeout: Optional[str], cooldown: Optional[str],
                 environ=os.environ) -> Optional[Options]:
    """The elastic options of a standalone command line (flags first, then MGPU_* variables).

    Returns:
        None when no discovery script is given (and no other elastic option).

    Raises:
        ValueError: a bad value or combination, with the fix in the message (a bad variable:
            mgpu_launch.config.settings.SettingError).
    """
    given = {}
    for name, flag, variable, value in (
            ("min_np", "--min-np", "MGPU_MIN_NP", min_np),
            ("max_np", "--max-np", "MGPU_MAX_NP", max_np),
            ("script", "--host-discovery-script", "MGPU_HOST_DISCOVERY_SCRIPT", script),
            ("timeout", "--elastic-timeout", "MGPU_ELASTIC_TIMEOUT", timeout),
            ("cooldown", "--blacklist-cooldown", "MGPU_BLACKLIST_COOLDOWN", cooldown)):
        if value is not None:
            given[name] = (flag, value)
        elif settings.is_set(variable, environ):  # a bad value: SettingError, a ValueError
            given[name] = (variable, settings.get(variable, environ))
    if "script" not in given:
        if given:
            raise ValueError(f"{', '.join(source for source, _ in given.values())} only apply "
                             f"with --host-discovery-script (elastic mode), e.g. --min-np 2 "
                             f"--max-np 4 --host-discovery-script ./discover.sh")
        return None
    source, path = given["script"]
    if not os.path.isfile(path):
        raise ValueError(f"{source} {path!r}: no such file; expected an executable that prints "
                         f"one HOST:SLOTS line per available host")
    if not os.access(path, os.X_OK):
        raise ValueError(f"{source} {path!r} is not executable: chmod +x {path}")
    low = _number(given["min_np"][1], given["min_np"][0], int, 1, "--min-np 2") \
        if "min_np" in given else np
    high = _number(given["max_np"][1], given["max_np"][0], int, 1, "--max-np 8") \
        if "max_np" in given else None
    if high is not None and low > high:
        raise ValueError(f"--min-np {low} is more than --max-np {high}: expected "
                         f"min <= max, e.g. --min-np 2 --max-np 4")
    if np < low or (high is not None and np > high):
        raise ValueError(f"-np {np} is outside [--min-np {low}, --max-np "
                         f"{high if high is not None else 'any'}]: give an -np between them")
    seconds = {name: _number(given[name][1], given[name][0], float, 0, example)
               for name, example in (("timeout", "--elastic-timeout 600"),
                                     ("cooldown", "--blacklist-cooldown 60")) if name in given}
    return Options(os.path.abspath(path), low, high, **seconds,
                   stop_repeated=settings.flag("MGPU_STOP_REPEATED_FAILURE", environ))


def discovery_interval() -> float:
    """MGPU_DISCOVERY_INTERVAL: seconds between discovery runs while waiting or training."""
    return max(0.2, settings.seconds("MGPU_DISCOVERY_INTERVAL"))


class _Noted:
    """Print each distinct line once (a script's bad line is not repeated every poll)."""

    def __init__(self):
        self.seen: Set[str] = set()

    def __call__(self, text: str) -> None:
        if text not in self.seen:
            self.seen.add(text)
            say(text)


class Watcher:
    """Polls discovery while the job runs; asks the job to stop when it should resize."""

    def __init__(self, options: Options, blacklist: discovery.Blacklist,
                 placed: hostlists.HostSlots, np: int, note: _Noted):
        self.options, self.blacklist, self.note = options, blacklist, note
        self.placed, self.np = placed, np
        self.current = placed.slots()
        self.done = threading.Event()
        self.why: Optional[str] = None  # set when the job was asked to stop

    def attach(self, proc, relay) -> None:
        threading.Thread(target=self._poll, args=(proc, relay), daemon=True).start()

    def stop(self) -> None:
        self.done.set()

    def _poll(self, proc, relay) -> None:
        while not self.done.wait(discovery_interval()):
            why = self.reason()
            # Not before the first step: the ranks' SIGUSR1 handler may not be in place yet.
            if why is None or not relay.progressed or proc.poll() is not None:
                continue
            self.why = why
            say(f"{why}: asking the job to stop at its next backup point")
            try:
                proc.send_signal(RESIZE_SIGNAL)
            except ProcessLookupError:
                pass
            return

    def reason(self) -> Optional[str]:
        """Why the job should restart with another size now, or None."""
        try:
            hosts = discovery.discover(self.options.script,
                                       bare_slots=self.options.bare_slots)
        except discovery.DiscoveryError as error:
            self.note(f"discovery failed, the job goes on as it is: {error}")
            return None
        for problem in hosts.problems:
            self.note(problem)
        offered = dict(hosts.slots)
        gone = sorted(set(self.current) - set(offered))
        # Horovod's rule: fewer slots on a host of the job removes the slots it lost.
        fewer = [f"{host} offers {offered[host]} slots, the job runs {count} processes there"
                 for host, count in self.current.items()
                 if host in offered and offered[host] < count]
        usable = hosts.without(self.blacklist.blocked())
        np, _ = discovery.place(usable, self.options.max_np)
        if gone:
            return (f"{', '.join(gone)} left the discovered hosts; restart with {np} "
                    f"processes")
        if fewer:
            return f"{'; '.join(fewer)}; restart with {np} processes (now {self.np})"
        if np > self.np:
            came = [f"{h} ({n} slots)" for h, n in usable.slots if h not in self.current]
            what = f"{', '.join(came)} came" if came else "more slots were discovered"
            return f"{what}; restart with {np} processes (now {self.np})"
        return None


def wait_for_slots(options: Options, blacklist: discovery.Blacklist, note: _Noted,
                   clock=time.monotonic, sleep=time.sleep) -> Optional[discovery.Hosts]:
    """Discovered, not blacklisted hosts with >= min_np slots; None after the timeout."""
    deadline = clock() + options.timeout
    while True:
        blocked = blacklist.blocked()
        try:
            found = discovery.discover(options.script, bare_slots=options.bare_slots)
            for problem in found.problems:
                note(problem)
            usable = found.without(blocked)
            if usable.total >= options.min_np:
                return usable
            listed = ",".join(f"{h}:{n}" for h, n in usable.slots) or "none"
            short = (f"{usable.total} slots available ({listed}"
                     + (f"; blacklisted: {', '.join(blocked)}" if blocked else "")
                     + f"), fewer than --min-np {options.min_np}")
        except discovery.DiscoveryError as error:
            short = f"discovery failed: {error}"
        left = deadline - clock()
        if left <= 0:
            say(f"stopping: {short}, for {options.timeout:g} s (--elastic-timeout). No process "
                f"of the job is left; its backups are where BackupAndRestore wrote them: start "
                f"it again when enough hosts are back.")
            return None
        note(f"waiting for slots: {short}; waiting up to {options.timeout:g} s")
        sleep(min(discovery_interval(), left))


class ElasticRestarts(restarts.Policy):
    """The elastic mode of the restart loop (mgpu_launcher.restarts, which lists how it differs
    from fixed restarts); ``start`` as for :func:`run`."""

    quiet_when_used_up = False

    def __init__(self, options: Options, start: Callable, max_restarts: int):
        self.options, self.run_attempt, self.max_restarts = options, start, max_restarts
        self.max_resizes = MAX_RESIZES
        self.blacklist = discovery.Blacklist(options.cooldown)
        self.note = _Noted()
        self.previous = self.watcher = None  # (np, placed) and Watcher of the last attempt
        self.placed = hostlists.HostSlots(())  # the hosts of the last attempt
        self.point = self.last = None  # the last backup point; (error, point) of the last failure

    def say(self, text: str) -> None:
        say(text)

    def start(self, attempt: int, why: Optional[str]):
        hosts = wait_for_slots(self.options, self.blacklist, self.note)
        if hosts is None:
            return None
        np, placed = discovery.place(hosts, self.options.max_np)
        if self.previous is None:
            say(f"starting {np} processes on {placed} (--min-np {self.options.min_np}, "
                f"--max-np {self.options.max_np if self.options.max_np is not None else 'any'})")
        else:
            say(f"restarting with {np} processes on {placed} (was {self.previous[0]} on "
                f"{self.previous[1]}): {why}; the job resumes from its last backup")
        self.watcher = Watcher(self.options, self.blacklist, placed, np, self.note)
        try:
            outcome = self.run_attempt(np, placed, attempt, self.watcher.attach)
        finally:
            self.watcher.stop()
        self.previous, self.placed = (np, placed), placed
        self.point = outcome.backup or self.point  # an attempt that wrote none resumed from it
        return outcome

    def resized(self, outcome) -> Optional[str]:
        if outcome.resized is None:
            return None
        self.last = None
        return f"the job stopped at its {outcome.resized} ({self.watcher.why or 'asked'})"

    def _lost(self, outcome):
        return discovery.hosts_named(outcome.lost_hosts, self.placed)

    def failed(self, outcome) -> str:
        lost = self._lost(outcome)
        return (elastic_failures.lost(lost, self.blacklist) if lost
                else elastic_failures.failed(outcome, self.placed, self.blacklist))

    def excused(self, outcome) -> bool:
        return elastic_failures.killed(outcome) or bool(self._lost(outcome))

    def repeated(self, outcome, failures: int) -> Optional[str]:
        seen, point = elastic_failures.repeated(outcome, self.point), self.point
        if self.options.stop_repeated and seen is not None and seen == self.last:
            where = (f"after the same backup point ({point})" if point else
                     "with no backup point reported by the job (each attempt starts over)")
            return (f"stopping: restarts were stopped because the failure repeated identically: "
                    f"the last two attempts both failed with the same error, {seen[0]} (rank "
                    f"{outcome.cause.rank}), {where}; every further restart would fail the "
                    f"same way ({failures - 1} of the {self.max_restarts} restarts allowed "
                    f"used). Fix the error in the failure summary above; "
                    f"MGPU_STOP_REPEATED_FAILURE=0 restarts anyway.")
        self.last = seen
        return None


def run(options: Options, start: Callable, max_restarts: int = DEFAULT_MAX_RESTARTS) -> int:
    """The elastic loop (see the module docstring); returns mgpu-train's exit status.

    Args:
        options: the validated elastic options.
        start: ``start(np, placed, attempt, on_start) -> supervisor.Outcome`` runs one
            attempt of the job on the hosts `placed` (a ``hostlists.HostSlots``;
            mgpu_launcher.api builds it).
        max_restarts: restarts after failures allowed (resizes asked by mgpu-train are not
            counted; at most :data:`MAX_RESIZES` of them). Two failed attempts in a row with
            the same error and the same last backup point end the loop early (see
            :func:`mgpu_launcher.elastic_failures.repeated`), unless ``options.stop_repeated``
            is off.
    """
    return restarts.run_attempts(ElasticRestarts(options, start, max_restarts))


def add_arguments(parser) -> None:
    """mgpu-train's elastic options (mgpu_launcher.cli's parser)."""
    group = parser.add_argument_group(
        "elastic training (standalone mode; docs/fault-tolerance.md#elastic-training)")
    group.add_argument("--host-discovery-script", metavar="FILE", help="an executable printing "
                       "the available hosts, one HOST:SLOTS per line; mgpu-train runs the job "
                       "on them and restarts it when hosts fail, leave or come "
                       "($MGPU_HOST_DISCOVERY_SCRIPT)")
    group.add_argument("--min-np", metavar="N", help="fewest processes to train with "
                       "(default: -np; $MGPU_MIN_NP)")
    group.add_argument("--max-np", metavar="N", help="most processes to grow to (default: all "
                       "discovered slots; $MGPU_MAX_NP)")
    group.add_argument("--elastic-timeout", metavar="S", help="seconds to wait for --min-np "
                       "slots before stopping (default 600; $MGPU_ELASTIC_TIMEOUT)")
    group.add_argument("--blacklist-cooldown", metavar="S", help="seconds a host where a rank "
                       "failed stays unused, doubled at each further failure (default 60; "
                       "$MGPU_BLACKLIST_COOLDOWN)")


def run_job(options: Options, build: Callable, *, all_ranks: bool, output_dir: Optional[str],
            merge_window: Optional[float], max_restarts: int, dry_run: bool) -> int:
    """Run the job elastically: :func:`run` with attempts started through the supervisor.

    Args:
        build: ``build(np, placed) -> (mpirun command, flavour, environment)``, `placed` the
            attempt's ``hostlists.HostSlots``.
        all_ranks, output_dir, merge_window: as for ``supervisor.supervise``.
        max_restarts: restarts after failures allowed.
        dry_run: print the mpirun command for the hosts discovered now, run nothing.
    """
    def start(np: int, placed: hostlists.HostSlots, attempt: int, on_start):
        command, flavour, env = build(np, placed)
        # MGPU_ELASTIC=1 is forwarded by `build` (-x); these are the values for this attempt.
        restarts.attempt_environment(env, attempt)[ELASTIC_VARIABLE] = "1"
        return supervisor.supervise(command, flavour, all_ranks=all_ranks,
                                    output_dir=output_dir, env=env, size=np,
                                    merge_window=merge_window, on_start=on_start)

    if dry_run:
        try:
            found = discovery.discover(options.script, bare_slots=options.bare_slots)
            np, placed = discovery.place(found, options.max_np)
        except discovery.DiscoveryError as error:
            say(f"--dry-run: {error}")
            return 2
        print(shlex.join(build(np, placed)[0]))
        return 0
    # SIGTERM between attempts (discovering hosts, waiting for slots) ends mgpu-train as
    # Ctrl-C does, through the same clean-up, not at once with a discovery script's group
    # left running; during an attempt the supervisor's own handler has it. SIGINT is handled
    # even where it was inherited ignored (a job started with `&` from a script), as the
    # supervisor does during an attempt.
    main = threading.current_thread() is threading.main_thread()  # (only it may set handlers)
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler) if main else None
    try:
        return run(options, start, max_restarts)
    except KeyboardInterrupt:  # Ctrl-C while waiting for slots (a running job: supervisor)
        return 128 + signal.SIGINT
    except _Terminated:
        return 128 + signal.SIGTERM
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
        discovery.end_all()  # a watcher thread's script too


class _Terminated(BaseException):
    """SIGTERM to mgpu-train outside an attempt (as KeyboardInterrupt is SIGINT)."""


def _terminate(signum, frame):
    raise _Terminated()
