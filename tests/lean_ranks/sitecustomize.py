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

scikit-learn (with SciPy, about 2 s of CPU) is refused only to Keras's scikit-learn wrappers
(``keras.wrappers``, which ``import keras`` loads and which take a missing scikit-learn as "not
installed"): the ranks that train on its digits data import it themselves, and get it.

``MGPU_TEST_LEAN_RANKS=0`` turns it all off.
"""

import os
import sys

#: the modules whose imports of scikit-learn fail in a rank
_NO_SKLEARN_FOR = "keras.src.wrappers"


class _NoSklearnForKerasWrappers:
    """A meta path finder that fails ``import sklearn`` when keras.src.wrappers asks."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "sklearn" and not name.startswith("sklearn."):
            return None
        frame = sys._getframe(1)
        while frame is not None:  # the first frame outside the import machinery: who imports
            caller = frame.f_globals.get("__name__") or ""
            if not caller.startswith("importlib") and caller != __name__:
                break
            frame = frame.f_back
        if frame is not None and caller.startswith(_NO_SKLEARN_FOR):
            raise ModuleNotFoundError(f"No module named {name!r} (tests/lean_ranks: "
                                      f"refused to {caller})", name=name)
        return None


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
    sys.meta_path.insert(0, _NoSklearnForKerasWrappers())


_lean()
