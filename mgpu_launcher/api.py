"""The launcher's API: a job's :class:`Config`, and :func:`launch`, which carries it out.

``mgpu-train`` parses its command line into a Config (mgpu_launcher.cli, which only parses);
``mgpu_launch.run`` builds one from its arguments. Both hand it to :func:`launch`:

* no ``np`` (worker mode): run the program in this process (mgpu_launcher.worker);
* hosts found by a discovery script: the elastic loop (mgpu_launcher.elastic);
* otherwise: mpirun on the given hosts, supervised (mgpu_launcher.supervisor), started again
  after a failure up to ``max_restarts`` times (:func:`run_with_restarts`).

Both modes restart through the one loop of mgpu_launcher.restarts (``run_attempts``), each
with its policy; what an attempt's ranks receive and when a failed job is not restarted are
decided there too.
"""

import dataclasses
import os
import secrets
import shlex
import sys
from typing import List, Optional, Tuple

from mgpu_launcher import elastic, hostfiles, hostlists, mpirun, restarts, supervisor, worker
from mgpu_launch.config import markers, settings
from mgpu_launcher.usage import PROG

#: Forwarded to every rank (remote hosts included) whenever they are set.
FORWARDED_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "KERAS_BACKEND",
                       "KERAS_HOME", "VIRTUAL_ENV")
FORWARDED_PREFIXES = ("MGPU_", "NCCL_", "XLA_", "TF_", "JAX_", "CUDA_", "OMP_")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything one mgpu-train invocation was asked to do."""

    kind: Optional[str]  # "script" | "module" | "code" | None (only with --env)
    target: Optional[str]
    args: Tuple[str, ...]
    np: Optional[int]  # None: worker mode (run in this process)
    hosts: Optional[hostlists.HostSlots] = None  # -H, read once (hostlists.parse_hosts)
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
    # a new key per job: the ranks' marker lines carry it, so the launcher never takes a rank's
    # own text for one (mgpu_launch.config.markers.line, mgpu_launcher.relay)
    env[markers.KEY_VARIABLE] = secrets.token_hex(8)
    if config.timeline:  # forwarded to the ranks with every MGPU_* variable
        env["MGPU_TIMELINE"] = config.timeline
    if config.max_restarts > 0:
        restarts.attempt_environment(env, 0)
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


def launch(config: Config) -> int:
    """Carry out `config` (worker mode, elastic, or fixed hosts with restarts); returns the exit
    status.

    Raises:
        mgpu_launcher.mpirun.MpirunNotFound: standalone mode and no mpirun.
    """
    if config.np is None:  # warns about unknown settings on rank 0
        if config.timeline:  # this process is the rank: its own environment
            os.environ["MGPU_TIMELINE"] = config.timeline
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


def supervise_once(config: Config, *, stdout=None, stderr=None,
                   run_folder: Optional[str] = None) -> supervisor.Outcome:
    """Build `config`'s job and run it once, supervised; no restart (``mgpu_launch.run``).

    Args:
        stdout, stderr: where the ranks' output goes (default: this process's).
        run_folder: a folder the supervisor's watchdog removes if this process dies.

    Raises:
        mgpu_launcher.mpirun.MpirunNotFound: no mpirun.
    """
    command, flavour, env = build_job(config)
    return supervisor.supervise(command, flavour, all_ranks=config.all_ranks_output, env=env,
                                stdout=stdout, stderr=stderr, size=config.np,
                                merge_window=config.merge_window, run_folder=run_folder)


def run_with_restarts(config: Config, command: List[str], flavour: mpirun.Flavour,
                      env: dict) -> int:
    """Run the job; after a failure start it again, up to ``config.max_restarts`` times.

    The restart loop is mgpu_launcher.restarts's (:class:`~mgpu_launcher.restarts.FixedRestarts`
    says how it restarts here). Not restarted: success, mgpu-train itself stopped by a signal,
    and a failure before any rank finished a training step (a SyntaxError, an ImportError, a
    wrong path: the same error would come back every time). Returns the last attempt's exit
    status.
    """
    def supervise(attempt: Optional[Tuple[int, int]]) -> supervisor.Outcome:
        return supervisor.supervise(
            command, flavour, all_ranks=config.all_ranks_output, output_dir=config.output_dir,
            env=env, attempt=attempt, size=config.np, merge_window=config.merge_window)

    return restarts.run_attempts(restarts.FixedRestarts(config.max_restarts, env, supervise))
