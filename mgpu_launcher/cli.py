"""``mgpu-train``: command line -> frozen config (``mgpu_launcher.api.Config``) -> launch.

This module only parses and checks the command line; ``mgpu_launcher.api.launch`` carries out
the Config. Two modes, chosen by ``-np``:

* **standalone** (``mgpu-train -np 4 train.py``): start the job through mpirun, which runs
  ``python -m mgpu_launcher train.py`` on every rank, and supervise it (mgpu_launcher.supervisor),
  starting it again after a failure with ``--max-restarts N``, or with
  ``--host-discovery-script`` on the hosts discovery lists (mgpu_launcher.elastic): one restart
  loop for both (mgpu_launcher.restarts);
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
from typing import Optional, Sequence

from mgpu_launcher import __version__, api, elastic, hostfiles, mpirun, relay, usage
from mgpu_launch.config import devices, environments, settings
from mgpu_launcher.api import Config
from mgpu_launcher.usage import KERAS_BACKENDS, PROG, UsageError  # noqa: F401 (public here)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see {PROG} --help)")


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
                     "DIR/rank.N.log (mode 0600; DIR must be a folder of yours only you may "
                     "write in, created 0700 when missing)")
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
    hosts = usage.parse_hosts(options.hosts) if options.hosts else None
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
    if options.output_dir and np is not None and not options.dry_run:
        try:  # before anything starts; the relay checks it again at every attempt
            relay.private_output_dir(options.output_dir)
        except (PermissionError, FileExistsError, NotADirectoryError) as error:
            raise UsageError(str(error)) from None
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
                  hosts=hosts or (placement.hosts if placement else None),
                  hostfile=placement.hostfile if placement else None, mpirun=options.mpirun,
                  mpirun_args=tuple(shlex.split(options.mpirun_args)),
                  forward=tuple(options.forward), output_dir=options.output_dir,
                  all_ranks_output=options.all_ranks_output, pin=options.pin,
                  dry_run=options.dry_run, max_restarts=max_restarts, elastic_options=grow,
                  merge_window=settings.seconds("MGPU_MERGE_SECONDS"), placement=placement,
                  timeline=os.path.abspath(options.timeline) if options.timeline else None)


def run(config: Config) -> int:
    """Carry out a parsed command line: ``--env``'s report, or :func:`mgpu_launcher.api.launch`;
    returns the exit status."""
    if config.env_report:
        from mgpu_launcher import envreport
        print(envreport.report(config.hostfile, config.slots_per_host))
        return 0
    return api.launch(config)


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
