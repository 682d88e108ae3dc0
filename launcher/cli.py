"""``mgpu-train``: command line -> frozen config -> run.

Two modes, chosen by ``-np``:

* **standalone** (``mgpu-train -np 4 train.py``): start the job through mpirun, which runs
  ``python -m mgpu_launcher train.py`` on every rank, and supervise it (mgpu_launcher.supervisor),
  starting it again after a failure with ``--max-restarts N`` (:func:`run_with_restarts`), or
  with ``--host-discovery-script`` on the hosts discovery lists (mgpu_launcher.elastic);
* **worker** (no ``-np``: ``mpirun -np 4 mgpu-train train.py``, ``srun mgpu-train train.py``, or
  plainly ``mgpu-train train.py`` for one process): run the program in this process
  (mgpu_launcher.worker).

Like ``python``, everything after the script name (or ``-m module`` / ``-c code``) belongs to
the program, not to mgpu-train.
"""

import argparse
import dataclasses
import os
import re
import shlex
import sys
from typing import List, Optional, Sequence, Tuple

from mgpu_launcher import (__version__, devices, elastic, environments, hostfiles, mpirun,
                           settings, supervisor, usage, worker)
from mgpu_launcher.usage import KERAS_BACKENDS, PROG, UsageError  # noqa: F401 (public here)

#: Forwarded to every rank (remote hosts included) whenever they are set.
FORWARDED_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "KERAS_BACKEND", "KERAS_HOME",
                       "VIRTUAL_ENV")
FORWARDED_PREFIXES = ("MGPU_", "NCCL_", "XLA_", "TF_", "JAX_", "CUDA_", "OMP_")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see {PROG} --help)")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one mgpu-train invocation was asked to do."""

    kind: Optional[str]  # "script" | "module" | "code" | None (only with --env)
    target: Optional[str]
    args: Tuple[str, ...]
    np: Optional[int]  # None: worker mode (run in this process)
    hosts: Optional[str] = None
    hostfile: Optional[str] = None
    mpirun: Optional[str] = None
    mpirun_args: Tuple[str, ...] = ()
    forward: Tuple[str, ...] = ()
    output_dir: Optional[str] = None
    all_ranks_output: bool = False
    pin: bool = True
    dry_run: bool = False
    env_report: bool = False
    max_restarts: int = 0
    merge_window: Optional[float] = None  # MGPU_MERGE_SECONDS (None: merge.DEFAULT_WINDOW)
    elastic_options: Optional[elastic.Options] = None  # --host-discovery-script given
    placement: Optional[hostfiles.Placement] = None  # a hostfile, given or the MPI Operator's
    slots_per_host: Optional[str] = None  # --slots-per-host as given (for --env)
    timeline: Optional[str] = None  # --timeline FILE, absolute: MGPU_TIMELINE of every rank


def get_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [options] (script.py | -m module | -c code) [args ...]",
        description="Run a Keras training program on N processes, one GPU each.",
        epilog="Examples:\n  mgpu-train -np 2 train.py --epochs 3\n"
               "  mpirun -np 4 mgpu-train train.py\n  srun -n 8 mgpu-train -m mypkg.train\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    job = parser.add_argument_group("starting the job (standalone mode)")
    job.add_argument("-np", "--num-proc", dest="np", metavar="N|auto",
                     help="start N processes through mpirun; 'auto' = one per visible GPU "
                          "(1 without GPUs). Leave out under mpirun/srun.")
    job.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts to run on")
    job.add_argument("--hostfile", metavar="FILE", help="Open MPI hostfile ('host slots=N'; "
                     "default: $OMPI_MCA_orte_default_hostfile, as the MPI Operator sets it)")
    job.add_argument("--slots-per-host", metavar="N", help="processes on each host listed "
                     "without slots (hostfile, discovery script); default: $MGPU_SLOTS_PER_HOST, "
                     "then $OMPI_MCA_orte_set_default_slots (the MPIJob's slotsPerWorker), else 1")
    job.add_argument("--mpirun", metavar="PATH", help="the mpirun to use (default: the one "
                     "pip installed beside this Python, then mpirun on PATH)")
    job.add_argument("--mpirun-args", metavar="'ARGS'", default="",
                     help="extra arguments for mpirun, as one quoted string")
    job.add_argument("-x", dest="forward", action="append", default=[], metavar="VAR[=VALUE]",
                     help="forward an environment variable to every rank (repeatable)")
    job.add_argument("--output-dir", metavar="DIR", help="write each rank's output to "
                     "DIR/rank.N.log")
    job.add_argument("--all-ranks-output", action="store_true",
                     help="show every rank's stdout (default: rank 0's; stderr always) and "
                          "do not merge the stderr lines several ranks print alike "
                          "(default: once, tagged [0-3]; MGPU_MERGE_SECONDS sets the window)")
    job.add_argument("--dry-run", action="store_true", help="print the mpirun command, run nothing")
    job.add_argument("--max-restarts", metavar="N", default=None,
                     help="after a failure, tear the job down and start it again, up to N times "
                          "(default: $MGPU_MAX_RESTARTS, else 0). A job that fails before its "
                          "first training step is done is not restarted.")
    elastic.add_arguments(parser)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="do not pin GPU local_rank to each process")
    parser.add_argument("--timeline", metavar="FILE", help="write a Chrome/Perfetto trace of "
                        "every rank's steps to FILE at the end (sets MGPU_TIMELINE)")
    parser.add_argument("--env", dest="env_report", action="store_true",
                        help="print versions, GPUs, the detected environment and the MGPU_* "
                             "settings, then exit")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return parser


def split_argv(parser: argparse.ArgumentParser, argv: Sequence[str]):
    """Split argv into (mgpu-train's options, kind, target, program args), as python does."""
    takes_value = {flag for action in parser._actions if action.nargs != 0
                   for flag in action.option_strings}
    argv = list(argv)
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in ("-m", "-c"):
            if index + 1 >= len(argv):
                raise UsageError(f"{token} needs an argument: "
                                 f"{'-m module' if token == '-m' else '-c code'}")
            kind = "module" if token == "-m" else "code"
            return argv[:index], kind, argv[index + 1], argv[index + 2:]
        if token == "--":
            if index + 1 >= len(argv):
                raise UsageError("'--' must be followed by the script to run")
            return argv[:index], "script", argv[index + 1], argv[index + 2:]
        if not token.startswith("-") or token == "-":
            return argv[:index], "script", token, argv[index + 1:]
        index += 2 if token in takes_value else 1
    return argv, None, None, []


def parse_args(argv: Sequence[str]) -> Config:
    """Parse and validate a command line (without the program name).

    Raises:
        UsageError: with the one-line explanation of what is wrong.
    """
    parser = get_parser()
    own, kind, target, args = split_argv(parser, argv)
    options = parser.parse_args(own)
    if options.env_report:  # prints the report, runs nothing (and shows bad settings)
        return Config(kind=kind, target=target, args=tuple(args), np=None, env_report=True,
                      hostfile=options.hostfile, slots_per_host=options.slots_per_host)
    usage.check_settings(options.forward)
    np = usage.parse_np(options.np)
    max_restarts = usage.parse_max_restarts(options.max_restarts)
    if options.hosts:
        usage.check_hosts(options.hosts)
    standalone_only = {"--hosts": options.hosts, "--hostfile": options.hostfile,
                       "--slots-per-host": options.slots_per_host,
                       "--mpirun": options.mpirun, "--mpirun-args": options.mpirun_args,
                       "-x": options.forward, "--output-dir": options.output_dir,
                       "--all-ranks-output": options.all_ranks_output,
                       "--dry-run": options.dry_run,
                       "--max-restarts": options.max_restarts is not None,
                       "--host-discovery-script": options.host_discovery_script,
                       "--min-np": options.min_np, "--max-np": options.max_np,
                       "--elastic-timeout": options.elastic_timeout,
                       "--blacklist-cooldown": options.blacklist_cooldown}
    given = [flag for flag, value in standalone_only.items() if value]
    if np is None and given:
        raise UsageError(f"{', '.join(given)} only apply when mgpu-train starts the job: add "
                         f"-np N (under mpirun or srun, use their own options instead)")
    if kind is None:
        raise UsageError("no program to run: give a script, -m module or -c code, "
                         f"e.g. {PROG} -np 2 train.py")
    if kind == "script":
        usage.check_script(target)
    for item in options.forward:
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(=.*)?$", item):
            raise UsageError(f"-x {item!r}: expected an environment variable NAME or "
                             f"NAME=VALUE, e.g. -x NCCL_DEBUG=INFO")
    usage.check_keras_backend(options.forward)
    grow = None
    if np is not None:
        try:
            grow = elastic.options_from(np, options.min_np, options.max_np,
                                        options.host_discovery_script, options.elastic_timeout,
                                        options.blacklist_cooldown)
        except ValueError as error:
            raise UsageError(str(error)) from None
    if grow and (options.hosts or options.hostfile):
        raise UsageError("--host-discovery-script lists the hosts: leave out --hosts and "
                         "--hostfile")
    if grow and options.max_restarts is None and not settings.is_set("MGPU_MAX_RESTARTS"):
        max_restarts = elastic.DEFAULT_MAX_RESTARTS
    try:  # the discovery script's bare host names get the slots a hostfile's would
        placement = hostfiles.placement_for(np, options) if np and not grow else None
        if grow:
            grow = dataclasses.replace(grow, bare_slots=hostfiles.slots_per_host(
                options.slots_per_host, os.environ)[0] or 1)
    except hostfiles.HostfileError as error:
        raise UsageError(str(error)) from None
    return Config(kind=kind, target=target, args=tuple(args), np=np,
                  hosts=options.hosts or (placement.hosts if placement else None),
                  hostfile=placement.hostfile if placement else None, mpirun=options.mpirun,
                  mpirun_args=tuple(shlex.split(options.mpirun_args)),
                  forward=tuple(options.forward), output_dir=options.output_dir,
                  all_ranks_output=options.all_ranks_output, pin=options.pin,
                  dry_run=options.dry_run, max_restarts=max_restarts, elastic_options=grow,
                  merge_window=settings.seconds("MGPU_MERGE_SECONDS"), placement=placement,
                  timeline=os.path.abspath(options.timeline) if options.timeline else None)


def worker_command(config: Config) -> List[str]:
    """What each rank runs: this launcher again, in worker mode, with the same program."""
    command = [sys.executable, "-m", "mgpu_launcher"]
    if not config.pin:
        command.append("--no-pin")
    if config.kind == "script":
        command += ["--", config.target]
    else:
        command += ["-m" if config.kind == "module" else "-c", config.target]
    return command + list(config.args)


def job_environment(config: Config) -> Tuple[dict, List[str]]:
    """The environment mpirun starts with, and the variable names it must forward."""
    env = dict(os.environ)
    if config.max_restarts > 0:
        # Rank 0 prints worker.PROGRESS_MARKER after its first step (a failure after it is
        # worth a restart), and every rank knows which restart it is (0: the first run).
        env.update(MGPU_PROGRESS_MARKER="1", MGPU_RESTART_COUNT="0")
    names = []
    for item in config.forward:
        name, has_value, value = item.partition("=")
        if has_value:
            env[name] = value
        names.append(name)
    names += [name for name in env if name in FORWARDED_VARIABLES
              or name.startswith(FORWARDED_PREFIXES)]
    return env, sorted(set(names))


def build_job(config: Config) -> Tuple[List[str], mpirun.Flavour, dict]:
    """The mpirun command, its flavour and its environment, for a standalone run."""
    path = mpirun.find_mpirun(config.mpirun)
    flavour = mpirun.detect_flavour(path)
    env, names = job_environment(config)
    if config.placement:  # mpirun sees only the hosts placed here (Open MPI 4 read it too)
        env.pop(hostfiles.HOSTFILE_VARIABLE, None)
    if mpirun.one_host(config.hosts, config.hostfile, config.mpirun_args, env):
        for name, value in flavour.one_host_env:  # the user's own setting wins
            env.setdefault(name, value)
    local = not (config.hosts or config.hostfile)
    command = mpirun.build_command(
        path, flavour, config.np, worker_command(config), hosts=config.hosts,
        hostfile=config.hostfile, forward=names, as_root=os.geteuid() == 0,
        oversubscribe=local and config.np > (os.cpu_count() or 1), extra=config.mpirun_args)
    return command, flavour, env


def run(config: Config) -> int:
    """Carry out a parsed command line; returns the exit status."""
    if config.env_report:
        from mgpu_launcher import envreport
        print(envreport.report(config.hostfile, config.slots_per_host))
        return 0
    if config.timeline:  # forwarded to the ranks with every MGPU_* variable
        os.environ["MGPU_TIMELINE"] = config.timeline
    if config.np is None:  # warns about unknown settings on rank 0
        return worker.run(config.kind, config.target, config.args, pin=config.pin)
    settings.warn_unknown(emit=lambda text: print(f"{PROG}: warning: {text}", file=sys.stderr))
    if config.elastic_options is not None:
        return elastic.run_job(
            config.elastic_options,
            lambda np, hosts: build_job(dataclasses.replace(
                config, np=np, hosts=hosts, forward=config.forward + ("MGPU_ELASTIC=1",))),
            all_ranks=config.all_ranks_output, output_dir=config.output_dir,
            merge_window=config.merge_window, max_restarts=config.max_restarts,
            dry_run=config.dry_run)
    command, flavour, env = build_job(config)
    if config.placement and not config.dry_run:
        print(f"{PROG}: hosts: {config.placement.describe()}", file=sys.stderr, flush=True)
    if config.dry_run:
        print(shlex.join(command))
        return 0
    return run_with_restarts(config, command, flavour, env)


def run_with_restarts(config: Config, command: List[str], flavour: mpirun.Flavour,
                      env: dict) -> int:
    """Run the job; after a failure start it again, up to ``config.max_restarts`` times.

    Every attempt is torn down completely first (the supervisor waits until no process of it
    is left). Not restarted: success, mgpu-train itself stopped by a signal, and a failure
    before any rank finished a training step (a SyntaxError, an ImportError, a wrong path:
    the same error would come back every time). Returns the last attempt's exit status.
    """
    attempts = config.max_restarts + 1
    for attempt in range(1, attempts + 1):
        env["MGPU_RESTART_COUNT"] = str(attempt - 1)
        outcome = supervisor.supervise(
            command, flavour, all_ranks=config.all_ranks_output, output_dir=config.output_dir,
            env=env, attempt=(attempt, attempts) if attempts > 1 else None, size=config.np,
            merge_window=config.merge_window)
        if outcome.status == 0 or outcome.stopped_by is not None or attempt == attempts:
            return outcome.status
        if not outcome.progressed:
            print(f"{PROG}: not restarting: attempt {attempt} failed before its first training "
                  f"step was done (e.g. a SyntaxError, an ImportError or a bad argument), so "
                  f"every restart would fail the same way. Fix the error above and run again.",
                  file=sys.stderr, flush=True)
            return outcome.status
        cause = outcome.cause
        why = (f"the job stalled: {cause.reason}" if cause and cause.stall else
               f"rank {cause.rank}: {cause.reason}" if cause else f"exit status {outcome.status}")
        print(f"{PROG}: restarting ({attempt} of {config.max_restarts} restarts used): "
              f"attempt {attempt} failed ({why}); every process of it is gone.",
              file=sys.stderr, flush=True)
    return outcome.status


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``mgpu-train``; returns the exit status (2: bad command line)."""
    try:
        config = parse_args(sys.argv[1:] if argv is None else argv)
        return run(config)
    except (UsageError, mpirun.MpirunNotFound) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    except (environments.DetectionError, devices.PinningError) as error:
        print(f"{PROG}: error: cannot place this process: {error}", file=sys.stderr)
        return 2
