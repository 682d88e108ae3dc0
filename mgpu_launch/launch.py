"""``mgpu_launch.run(fn, np=N)``: start a Python function on N ranks from Python.

For notebooks and Python drivers (what ``horovod.run`` and accelerate's ``notebook_launcher``
do). The function, its arguments and later its results travel as pickles through a folder:

1. the caller pickles ``(fn, args, kwargs)`` into a fresh work folder;
2. it starts the job through the same launcher as ``mgpu-train -np N`` (standalone mpirun,
   rank-tagged output, a failing rank ends the job), each rank running
   ``python -m mgpu_launch.launch WORK_DIR``;
3. each rank unpickles and calls ``fn(*args, **kwargs)``, then writes its result, or, when fn
   raises, its traceback, before the failure ends the job;
4. the caller reads them back: rank 0's result (or every rank's), or raises
   :class:`RemoteError` with the failing rank's traceback.

Pickling uses ``cloudpickle`` when it is installed: it sends functions defined in a notebook or
in ``python -c`` (``__main__``), lambdas and closures by value. Plain ``pickle`` sends functions
by reference (module and name), so without cloudpickle fn must live in an importable module.

This module imports no deep-learning framework: only the caller's fn does, on the ranks.
"""

import json
import os
import pickle
import shutil
import sys
import tempfile
import traceback
from typing import Any, Callable, Dict, Optional, Sequence

from mgpu_launcher import cli, mpirun, supervisor

PAYLOAD = "payload.pkl"


class RemoteError(RuntimeError):
    """A rank of an ``mgpu_launch.run`` job failed; the message holds its traceback.

    Attributes:
        rank: the rank whose failure is reported (the first to fail, when known).
        remote_type: the exception's class name on that rank (None if it died otherwise).
        remote_traceback: the traceback as that rank printed it (or the job's failure summary).
        exit_status: the job's exit status.
    """

    def __init__(self, message: str, rank: Optional[int], remote_type: Optional[str],
                 remote_traceback: str, exit_status: int):
        super().__init__(message)
        self.rank, self.remote_type = rank, remote_type
        self.remote_traceback, self.exit_status = remote_traceback, exit_status


def _pickler():
    try:
        import cloudpickle
        return cloudpickle.dumps, True
    except ImportError:
        return pickle.dumps, False


def _dumps(obj: Any, what: str) -> bytes:
    dumps, by_value = _pickler()
    module = getattr(obj, "__module__", None) if callable(obj) else None
    if not by_value and module == "__main__":
        raise TypeError(
            f"mgpu_launch.run: {what} {getattr(obj, '__qualname__', obj)!r} is defined in "
            f"__main__ (a notebook, `python -c` or the driver script), which the ranks cannot "
            f"import; plain pickle only sends a function's module and name. Fix: pip install "
            f"cloudpickle (mgpu_launch.run then sends the function itself), or move it into a "
            f"module the ranks can import.")
    try:
        return dumps(obj)
    except Exception as error:  # pickle raises several types: PicklingError, TypeError, ...
        hint = ("cloudpickle could not pickle it either: it holds something that cannot leave "
                "this process (an open file, a lock, a live model); create that inside fn "
                "instead." if by_value else
                "Fix: pip install cloudpickle (it pickles lambdas, closures and notebook "
                "functions), or make it a module-level function.")
        raise TypeError(f"mgpu_launch.run: {what} cannot be pickled "
                        f"({type(error).__name__}: {error}). {hint}") from error


class _Tee:
    """Writes to a stream and keeps the last lines (for the failure summary)."""

    def __init__(self, stream):
        self.stream, self.text = stream, []

    def write(self, text):
        self.text.append(text)
        del self.text[:-200]
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()


def run(fn: Callable, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        np: int = 1, hosts: Optional[str] = None, hostfile: Optional[str] = None,
        all_ranks: bool = False, env: Optional[Dict[str, str]] = None,
        mpirun_args: Sequence[str] = (), all_ranks_output: bool = False,
        work_dir: Optional[str] = None) -> Any:
    """Run ``fn(*args, **kwargs)`` on `np` processes, as ``mgpu-train -np N`` would.

    fn runs as a rank's program: it calls ``mgpu.init()`` (or ``hvd.init()``) itself, like a
    training script. Output is relayed as with mgpu-train (rank 0's stdout, every stderr).

    Args:
        fn: the function; picklable (see the module docstring: cloudpickle is used if present).
        args, kwargs: its arguments; picklable.
        np: number of processes.
        hosts: ``"host1:4,host2:4"`` as for ``mgpu-train -H``; with other hosts, `work_dir`
            must be a folder every host sees at the same path (a shared file system).
        hostfile: an Open MPI hostfile, as for ``mgpu-train --hostfile``.
        all_ranks: return every rank's result as a list (rank order) instead of rank 0's.
        env: environment variables to set for the ranks (forwarded by mpirun).
        mpirun_args: extra mpirun arguments, as a list.
        all_ranks_output: show every rank's stdout, not only rank 0's.
        work_dir: where the pickles go (default: a temporary folder, removed afterwards).

    Returns:
        What fn returned on rank 0, or the list of every rank's results with `all_ranks`.

    Raises:
        TypeError: fn, args or kwargs cannot be pickled (the message says how to fix it).
        ValueError: np is not a whole number >= 1.
        RemoteError: a rank failed; the message has its traceback.

    Example:
        >>> def train(epochs):
        ...     import mgpu_launch as mgpu
        ...     mgpu.init()
        ...     return mgpu.rank(), mgpu.size()
        >>> mgpu_launch.run(train, args=(3,), np=2, all_ranks=True)
        [(0, 2), (1, 2)]
    """
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"mgpu_launch.run: np={np!r}; expected a whole number of processes "
                         f">= 1, e.g. np=2")
    _dumps(fn, "fn")  # alone first: its message names the function
    payload = _dumps((fn, tuple(args), dict(kwargs or {})), "args/kwargs")
    own_dir = work_dir is None
    folder = tempfile.mkdtemp(prefix="mgpu-run-") if own_dir else os.path.abspath(work_dir)
    os.makedirs(folder, exist_ok=True)
    try:
        with open(os.path.join(folder, PAYLOAD), "wb") as f:
            f.write(payload)
        forward = tuple(f"{name}={value}" for name, value in (env or {}).items())
        config = cli.Config(kind="module", target=__name__, args=(folder,), np=np, hosts=hosts,
                            hostfile=hostfile, mpirun_args=tuple(mpirun_args), forward=forward,
                            all_ranks_output=all_ranks_output)
        try:
            command, flavour, job_env = cli.build_job(config)
        except mpirun.MpirunNotFound as error:
            raise RuntimeError(f"mgpu_launch.run: {error}") from None
        stderr = _Tee(sys.stderr)
        outcome = supervisor.supervise(command, flavour, all_ranks=all_ranks_output, env=job_env,
                                       stdout=sys.stdout, stderr=stderr, size=np,
                                       merge_window=cli.merge_window())
        if outcome.status != 0:
            raise _failure(folder, outcome.status, "".join(stderr.text))
        results = []
        for rank in range(np if all_ranks else 1):
            with open(os.path.join(folder, f"result.{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results if all_ranks else results[0]
    finally:
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _failure(folder: str, status: int, console: str) -> RemoteError:
    """The first rank's error report (by time written), else the job's failure summary."""
    reports = sorted((entry for entry in os.listdir(folder) if entry.startswith("error.")),
                     key=lambda entry: os.path.getmtime(os.path.join(folder, entry)))
    if reports:
        with open(os.path.join(folder, reports[0])) as f:
            report = json.load(f)
        return RemoteError(
            f"mgpu_launch.run: rank {report['rank']} failed with {report['type']}: "
            f"{report['message']}\n\nTraceback on rank {report['rank']}:\n"
            f"{report['traceback']}", report["rank"], report["type"], report["traceback"],
            status)
    summary = console[console.rfind("mgpu-train: the job failed"):] or console
    return RemoteError(f"mgpu_launch.run: the job failed (exit status {status}) without a "
                       f"Python exception on any rank:\n{summary}", None, None, summary, status)


def _write(path: str, data: bytes) -> None:
    with open(path + ".partial", "wb") as f:
        f.write(data)
    os.replace(path + ".partial", path)


def run_rank(folder: str) -> None:
    """One rank of an ``mgpu_launch.run`` job (``python -m mgpu_launch.launch WORK_DIR``)."""
    rank = int(os.environ.get("MGPU_RANK", "0"))
    with open(os.path.join(folder, PAYLOAD), "rb") as f:
        fn, args, kwargs = pickle.load(f)
    try:
        result = _dumps(fn(*args, **kwargs), f"the value fn returned on rank {rank}")
    except BaseException as error:  # noqa: B036 - SystemExit and Ctrl-C are failures too
        report = {"rank": rank, "type": type(error).__name__, "message": str(error),
                  "traceback": "".join(traceback.format_exception(error))}
        _write(os.path.join(folder, f"error.{rank}.json"), json.dumps(report).encode())
        raise  # the launcher's worker prints it, marks the failure and ends the job
    _write(os.path.join(folder, f"result.{rank}.pkl"), result)


if __name__ == "__main__":
    run_rank(sys.argv[1])
