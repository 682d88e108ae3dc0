"""``mgpu_launch.run(fn, np=N)``: start a Python function on N ranks from Python.

For notebooks and Python drivers (what ``horovod.run`` and accelerate's ``notebook_launcher``
do). The function, its arguments and later its results travel as pickles through a folder:

1. the caller pickles ``(fn, args, kwargs)`` into a work folder of its own (see below);
2. it starts the job through the same launcher as ``mgpu-train -np N`` (standalone mpirun,
   rank-tagged output, a failing rank ends the job), each rank running
   ``python -m mgpu_launcher.python_api WORK_DIR``;
3. each rank unpickles and calls ``fn(*args, **kwargs)``, then writes its result, or, when fn
   raises, its traceback, before the failure ends the job;
4. the caller reads them back: rank 0's result (or every rank's), or raises
   :class:`RemoteError` with the failing rank's traceback.

Pickling uses ``cloudpickle`` when it is installed: it sends functions defined in a notebook or
in ``python -c`` (``__main__``), lambdas and closures by value. Plain ``pickle`` sends functions
by reference (module and name), so without cloudpickle fn must live in an importable module.

Nobody else can swap what travels (docs/security.md): the caller creates the work folder
itself (mode 0700), or accepts an existing one only when it is its own, nobody else may write
in it and nobody else can redirect its path (``runtime.folders.private_folder``); every file
is created anew (``O_EXCL | O_NOFOLLOW``, mode 0600), so a planted symbolic link is never
written through; and the payload and each result carry an HMAC under a
key of this call alone, handed to the ranks in their environment (``MGPU_RUN_KEY``): a file
whose HMAC does not match is an error, never unpickled.

This module imports no deep-learning framework: only the caller's fn does, on the ranks.
"""

import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import traceback
from typing import Any, Callable, Dict, Optional, Sequence

from mgpu_launch.runtime import auth, folders
from mgpu_launcher import api, hostlists, mpirun
from mgpu_launch.config import settings

PAYLOAD = "payload.pkl"
#: the ranks' environment variable with the call's key (hex); never on a command line
KEY_VARIABLE = "MGPU_RUN_KEY"
# The files a call writes (and the next call in the same work_dir removes first).
_OUR_FILE = re.compile(r"^(payload\.pkl|result\.\d+\.pkl|error\.\d+\.json|"
                       r"\.(result\.\d+\.pkl|error\.\d+\.json)\.partial-\d+)$")


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
        work_dir: Optional[str] = None, timeline: Optional[str] = None) -> Any:
    """Run ``fn(*args, **kwargs)`` on `np` processes, as ``mgpu-train -np N`` would.

    fn runs as a rank's program: it calls ``mgpu.init()`` (or ``hvd.init()``) itself, like a
    training script. Output is relayed as with mgpu-train (rank 0's stdout, every stderr).

    Args:
        fn: the function; picklable (see the module docstring: cloudpickle is used if present).
        args, kwargs: its arguments; picklable.
        np: number of processes.
        hosts: ``"host1:4,host2:4"`` as for ``mgpu-train -H`` (an entry that does not parse
            is a ValueError); with other hosts, `work_dir`
            must be a folder every host sees at the same path (a shared file system).
        hostfile: an Open MPI hostfile, as for ``mgpu-train --hostfile``.
        all_ranks: return every rank's result as a list (rank order) instead of rank 0's.
        env: environment variables to set for the ranks (forwarded by mpirun).
        mpirun_args: extra mpirun arguments, as a list.
        all_ranks_output: show every rank's stdout, not only rank 0's.
        work_dir: where the pickles go (default: a temporary folder, removed afterwards).
            Created with mode 0700 when it does not exist; an existing one must be a folder
            of yours that no other user may write in, on a path no other user may change
            (else PermissionError). Files of an earlier call there are replaced.
        timeline: a file for the job's timeline, a Chrome/Perfetto trace of every rank's
            step phases (as ``mgpu-train --timeline FILE``; ``MGPU_TIMELINE``).

    Returns:
        What fn returned on rank 0, or the list of every rank's results with `all_ranks`.

    Raises:
        TypeError: fn, args or kwargs cannot be pickled (the message says how to fix it).
        ValueError: np is not a whole number >= 1, an entry of `hosts` does not parse, or an
            ``MGPU_*`` variable (here or in `env`) has a bad value (mgpu_launch.config.settings.SettingError, before anything starts).
        PermissionError: `work_dir` is not a folder of yours that only you may write in, or
            another user could redirect its path (a folder or link of theirs on the way).
        RemoteError: a rank failed; the message has its traceback.
        RuntimeError: a result file does not carry this call's HMAC (someone changed it).

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
    env = dict(env or {})
    if timeline is not None:
        if not isinstance(timeline, (str, os.PathLike)) or not os.fspath(timeline).strip():
            raise ValueError(f"mgpu_launch.run: timeline={timeline!r}; expected a file path, "
                             f"e.g. timeline='timeline.json'")
        timeline = os.path.abspath(os.fspath(timeline))
    settings.check({**os.environ, **{name: str(value) for name, value in env.items()},
                    **({"MGPU_TIMELINE": timeline} if timeline else {})})
    placed = hostlists.parse_hosts(hosts) if hosts else None  # a ValueError names the entry
    _dumps(fn, "fn")  # alone first: its message names the function
    payload = _dumps((fn, tuple(args), dict(kwargs or {})), "args/kwargs")
    own_dir = work_dir is None
    folder = tempfile.mkdtemp(prefix="mgpu-run-") if own_dir else own_folder(work_dir)
    key = auth.new_key()
    try:
        folders.create_new(os.path.join(folder, PAYLOAD), auth.sign(key, "payload", payload))
        forward = tuple(f"{name}={value}" for name, value in env.items())
        forward += (f"{KEY_VARIABLE}={key.hex()}",)  # mpirun gets -x NAME: no value on argv
        config = api.Config(kind="module", target=__name__, args=(folder,), np=np, hosts=placed,
                            hostfile=hostfile, mpirun_args=tuple(mpirun_args), forward=forward,
                            all_ranks_output=all_ranks_output, timeline=timeline,
                            merge_window=settings.seconds("MGPU_MERGE_SECONDS"))
        stderr = _Tee(sys.stderr)
        try:
            outcome = api.supervise_once(config, stdout=sys.stdout, stderr=stderr,
                                         run_folder=folder if own_dir else None)
        except mpirun.MpirunNotFound as error:
            raise RuntimeError(f"mgpu_launch.run: {error}") from None
        if outcome.status != 0:
            raise _failure(folder, key, outcome.status, "".join(stderr.text))
        results = [pickle.loads(_read_signed(folder, key, f"result.{rank}.pkl", f"result {rank}"))
                   for rank in range(np if all_ranks else 1)]
        return results if all_ranks else results[0]
    finally:
        if own_dir:
            shutil.rmtree(folder, ignore_errors=True)


def _failure(folder: str, key: bytes, status: int, console: str) -> RemoteError:
    """The first rank's error report (by time written), else the job's failure summary."""
    reports = sorted((entry for entry in os.listdir(folder)
                      if entry.startswith("error.") and entry.endswith(".json")),
                     key=lambda entry: os.path.getmtime(os.path.join(folder, entry)))
    if reports:
        rank = reports[0].split(".")[1]
        report = json.loads(_read_signed(folder, key, reports[0], f"error {rank}"))
        return RemoteError(
            f"mgpu_launch.run: rank {report['rank']} failed with {report['type']}: "
            f"{report['message']}\n\nTraceback on rank {report['rank']}:\n"
            f"{report['traceback']}", report["rank"], report["type"], report["traceback"],
            status)
    summary = console[console.rfind("mgpu-train: the job failed"):] or console
    return RemoteError(f"mgpu_launch.run: the job failed (exit status {status}) without a "
                       f"Python exception on any rank:\n{summary}", None, None, summary, status)


def own_folder(work_dir: str) -> str:
    """`work_dir` as a real absolute path, created 0700, or checked to be the caller's alone.

    The check is :func:`mgpu_launch.runtime.folders.private_folder`'s (every folder and link
    on the path too). Files an earlier call left there are removed (the folder is ours:
    nobody else put them).

    Raises:
        PermissionError: it is not a folder, belongs to another user, others may write in
            it, or another user could redirect its path (a folder or link of theirs on the
            way, or a folder everybody may write in without the sticky bit).
    """
    try:
        folder = folders.private_folder(work_dir, "work_dir")
    except (folders.UnsafeFolder, FileExistsError, NotADirectoryError) as error:
        problem = getattr(error, "problem", None) or str(error)
        raise PermissionError(
            f"mgpu_launch.run: {problem}, so another user could swap the function, its "
            f"arguments or its results. Fix: give a work_dir that does not exist yet in a "
            f"folder of yours (mgpu_launch.run creates it, mode 0700), or leave work_dir out "
            f"(a private temporary folder).") from None
    for entry in os.listdir(folder):
        if _OUR_FILE.match(entry):
            os.remove(os.path.join(folder, entry))
    return folder


def _read_signed(folder: str, key: bytes, name: str, label: str) -> bytes:
    """A signed file's data; a file without this call's HMAC is an error, never unpickled."""
    with os.fdopen(os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        blob = f.read()
    try:
        return auth.verify(key, label, blob)
    except auth.Rejected as error:
        raise RuntimeError(f"mgpu_launch.run: {os.path.join(folder, name)}: {error}; it was "
                           f"not unpickled. Is another program writing into {folder!r}?") from None


def _write(folder: str, name: str, data: bytes) -> None:
    partial = os.path.join(folder, f".{name}.partial-{os.getpid()}")
    folders.create_new(partial, data)
    os.replace(partial, os.path.join(folder, name))


def run_rank(folder: str) -> None:
    """One rank of an ``mgpu_launch.run`` job (``python -m mgpu_launcher.python_api WORK_DIR``).

    Raises:
        RuntimeError: the payload does not carry the call's HMAC (``MGPU_RUN_KEY``), or that
            variable is missing: nothing is unpickled.
    """
    rank = settings.integer("MGPU_RANK", fallback=0)
    hex_key = settings.text(KEY_VARIABLE) or ""
    os.environ.pop(KEY_VARIABLE, None)  # fn's own child processes need not see it
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        key = b""
    if not key:
        raise RuntimeError(f"mgpu_launcher.python_api: {KEY_VARIABLE} is not set (or not hex): "
                           f"this module runs only as a rank of mgpu_launch.run, which sets it")
    fn, args, kwargs = pickle.loads(_read_signed(folder, key, PAYLOAD, "payload"))
    try:
        result = _dumps(fn(*args, **kwargs), f"the value fn returned on rank {rank}")
    except BaseException as error:  # noqa: B036 - SystemExit and Ctrl-C are failures too
        report = {"rank": rank, "type": type(error).__name__, "message": str(error),
                  "traceback": "".join(traceback.format_exception(error))}
        _write(folder, f"error.{rank}.json",
               auth.sign(key, f"error {rank}", json.dumps(report).encode()))
        raise  # the launcher's worker prints it, marks the failure and ends the job
    _write(folder, f"result.{rank}.pkl", auth.sign(key, f"result {rank}", result))


if __name__ == "__main__":
    run_rank(sys.argv[1])
