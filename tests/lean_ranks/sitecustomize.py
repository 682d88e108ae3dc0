"""Rank processes of the test suite only: no optional package a rank never uses.

tests/conftest.py's ``job_env`` puts this folder on the PYTHONPATH of every job a test starts;
Python imports this module at start-up. In a process started by mpirun (a rank), it marks
matplotlib and IPython, and jax / jaxlib unless the rank's KERAS_BACKEND is jax, as not
installed (``sys.modules[name] = None``: ``import`` raises ImportError and
``importlib.util.find_spec`` returns None, which Keras and TensorFlow take as "not installed").
CI installs every backend into one environment, and Keras and TensorFlow import these packages
merely because they are there (TensorFlow's tf.lite imports jax; Keras its plotting and notebook
helpers): 1-3 s of CPU per rank, a few hundred ranks per pass on a 2-core machine. No rank of
the suite uses them; one that did would fail with an ImportError naming the package.
``MGPU_TEST_LEAN_RANKS=0`` turns it off.
"""

import os
import sys


def _lean() -> None:
    if os.environ.get("MGPU_TEST_LEAN_RANKS", "1") == "0":
        return
    if os.environ.get("OMPI_COMM_WORLD_RANK") is None and os.environ.get("PMIX_RANK") is None:
        return  # not a rank: the test's own drivers (mgpu-bench plots with matplotlib)
    names = ["matplotlib", "IPython"]
    if os.environ.get("KERAS_BACKEND") in ("tensorflow", "torch"):
        names += ["jax", "jaxlib"]
    for name in names:
        sys.modules.setdefault(name, None)


_lean()
