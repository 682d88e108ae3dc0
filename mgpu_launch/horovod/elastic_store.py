"""The commits of a model-less elastic state (``ObjectState``, ``TensorFlowState``) on disk.

``KerasState`` commits through ``callbacks.BackupAndRestore``'s model backups; a state without
a Keras model has no model to save, so its commits are files of their own, kept the same way:

- rank 0 alone writes them, in a folder that must be its user's alone
  (:func:`mgpu_launch.runtime.folders.private_folder`, checked at every write and read);
- each commit is one ``commit-<n>.npz``: the variables' values (``v0``, ``v1``, ...) and one
  JSON text (``mgpu_state``: the writer's size and the state's attributes), built in memory,
  written to a hidden partial file created with ``O_EXCL | O_NOFOLLOW`` (mode 0600) and
  renamed into place, so a kill at any moment leaves the last complete commit; the newest 2
  are kept;
- reading one back is data only: the entries' names and every array header (shape, dtype,
  size) checked against the state's variables before any data is read, so a planted file
  cannot make rank 0 allocate more than the state; then numpy's loader with pickles refused,
  the JSON through :func:`mgpu_launch.training.epoch_resume.checked_state` (bounded depth, NaN
  and Infinity refused, as the writer's ``allow_nan=False``), the attributes through the
  state's own check. The arrays are the variables' values: one holding NaN (a diverged step,
  a damaged file) is refused, naming the variable; Infinity is loaded, with a warning naming
  it (a variable may hold it, e.g. a best loss not yet set). A commit that fails a check is
  refused on every rank (``BadBackup``), not skipped: in a private folder it means a tampered
  file. A file that cannot be read at all is skipped, with a warning, for the older one.

This module imports no deep-learning framework.
"""

import io
import json
import os
import re
import stat
import warnings
import zipfile
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from mgpu_launch.horovod.elastic_state import is_chief, size
from mgpu_launch import runtime
from mgpu_launch.runtime import agreement, folders
from mgpu_launch.training.epoch_resume import BadBackup, checked_state

__all__ = ["CommitStore"]

_COMMIT = re.compile(r"^commit-(\d{1,12})\.npz$")
_PARTIAL = re.compile(r"^\.commit-\d{1,12}\.partial-\d+\.npz$")  # a writer killed mid-write
_STATE = "mgpu_state"  # the npz entry holding the JSON text
_ATTRIBUTES = "elastic_state"  # the key of the attributes in that text (as KerasState's)
_KEEP = 2  # an older commit to fall back on when the newest cannot be read

Loaded = Tuple[int, dict, Optional[List[np.ndarray]]]


class CommitStore:
    """Rank 0's commit files for one state.

    Args:
        folder: the state's ``backup_dir``.
        owner: the state's class name, for messages.
    """

    def __init__(self, folder: str, owner: str):
        self.folder, self.owner = folder, owner

    def _private(self, create: bool = True) -> str:
        return folders.private_folder(self.folder, "backup_dir", create=create)

    @staticmethod
    def _commits(folder: str) -> List[Tuple[int, str]]:
        """(number, path) of every complete commit (plain files only), newest first."""
        found = []
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if (match := _COMMIT.match(name)) and stat.S_ISREG(os.lstat(path).st_mode):
                found.append((int(match.group(1)), path))
        return sorted(found, reverse=True)

    def save(self, attributes: dict, arrays: Sequence[np.ndarray]) -> None:
        """Write a commit (rank 0; the other ranks return at once).

        Args:
            attributes: the state's attributes, already checked to be JSON data.
            arrays: the variables' values, in the state's order.

        Raises:
            folders.UnsafeFolder: the folder is not this user's alone (nothing is written).
            OSError: the commit cannot be written.
        """
        if not is_chief():
            return
        folder = self._private()  # checked at every write: nothing is written through others'
        commits = self._commits(folder)
        number = commits[0][0] + 1 if commits else 1
        text = json.dumps({"size": size(), _ATTRIBUTES: attributes}, allow_nan=False)
        buffer = io.BytesIO()
        np.savez(buffer, **{_STATE: np.array(text)},
                 **{f"v{index}": _stored(array) for index, array in enumerate(arrays)})
        path = os.path.join(folder, f"commit-{number}.npz")
        partial = os.path.join(folder, f".commit-{number}.partial-{os.getpid()}.npz")
        if os.path.lexists(partial):
            os.remove(partial)  # an earlier process's with our pid: a link is removed, not followed
        folders.create_new(partial, buffer.getvalue(), mode=0o600)
        try:
            os.replace(partial, path)
        finally:
            if os.path.lexists(partial):
                os.remove(partial)
        for _, old in self._commits(folder)[_KEEP:]:
            os.remove(old)

    def load_everywhere(self, check_attributes: Callable[[dict], dict],
                        like: Sequence[np.ndarray],
                        names: Sequence[str] = ()) -> Optional[Loaded]:
        """Collective: the newest commit, read by rank 0 and checked; None when there is none.

        Args:
            check_attributes: the state's check of the attributes (raises ValueError).
            like: the variables' current values: each array read must have one's shape and
                dtype.
            names: the variables' names, for messages (index order; may be empty).

        Returns:
            ``(size of the job that wrote it, attributes, arrays)`` on every rank; the arrays
            on rank 0 only (None elsewhere: the state's ``sync()`` sends rank 0's variables).

        Raises:
            PermissionError: the folder is not rank 0's user's alone (every rank).
            BadBackup: the newest readable commit fails a check, a variable holding NaN
                included (every rank).
        """
        arrays = []  # rank 0's, kept here: only the job size and attributes are broadcast

        def load_on_chief():
            found = self._load_on_chief(check_attributes, like, names)
            if found is None:
                return None
            written_by, attributes, read = found
            arrays.append(read)
            return written_by, attributes

        found = agreement.decided_by_root(runtime.state.transport, load_on_chief, {
            folders.UnsafeFolder: lambda why: PermissionError(
                f"{self.owner}: rank 0 refuses to read or write commits there: {why}"),
            BadBackup: lambda why: BadBackup(
                f"{self.owner}: refused the commit {why}. Nothing of it was used. Delete "
                f"that file to resume from the older commit (or the folder to start afresh). "
                f"mgpu never writes a commit that fails this check: look for what else writes "
                f"there")})
        if found is None:
            return None
        return found[0], found[1], arrays[0] if arrays else None

    def _load_on_chief(self, check_attributes, like, names=()) -> Optional[Loaded]:
        try:
            folder = self._private(create=False)
        except FileNotFoundError:
            return None
        for name in os.listdir(folder):
            if _PARTIAL.match(name):
                os.remove(os.path.join(folder, name))  # a link is removed, never followed
        for _, path in self._commits(folder):
            try:
                entries = _read(path, like)
            except _Refused as error:
                raise BadBackup(f"{path}: {error}") from None
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
                warnings.warn(f"{self.owner}: cannot read {path} ({error}); trying an older "
                              f"commit", stacklevel=3)
                continue
            try:
                loaded = _checked(entries, check_attributes, like)
                _check_finite(loaded[2], names, self.owner, path)
                return loaded
            except ValueError as error:
                raise BadBackup(f"{path}: {error}") from None
        return None

    def delete(self) -> None:
        """Remove the folder (rank 0), unless another user could have redirected it."""
        folders.remove_private(self.folder, "backup_dir", self.owner, "the commits")


def _check_finite(arrays: Sequence[np.ndarray], names: Sequence[str], owner: str,
                  path: str) -> None:
    """Refuse a commit whose variables hold NaN; warn about Infinity, which a variable may
    legitimately hold (a best loss not yet set), naming the variables either way.

    NaN is what a diverged step or a damaged file leaves; loading it would only train NaN from
    there, silently (issue 58). Integer variables hold neither.

    Raises:
        ValueError: the first variable holding NaN (the caller makes it a ``BadBackup`` on every
            rank).
    """
    infinite = []
    for index, array in enumerate(arrays):
        if array.dtype.kind in "iub":
            continue
        try:  # float and complex as they are; bfloat16 (ml_dtypes, kind "V") through float64
            values = array if array.dtype.kind in "fc" else array.astype(np.float64)
            nan, inf = np.isnan(values), np.isinf(values)
        except (TypeError, ValueError):
            continue  # not a number type
        label = f"variable {index}" + (f" ({names[index]})" if index < len(names) else "")
        if nan.any():
            raise ValueError(f"{label} holds NaN ({int(nan.sum())} of {nan.size} values), which "
                             f"a training that diverged or a damaged file leaves; loading it "
                             f"would train on NaN")
        if inf.any():
            infinite.append(label)
    if infinite:
        warnings.warn(f"{owner}: the commit {path}: {', '.join(infinite)} "
                      f"{'holds' if len(infinite) == 1 else 'hold'} Infinity; loaded as it is "
                      f"(a value such as a best loss not yet set may be)", stacklevel=4)


def _stored(array) -> np.ndarray:
    """`array` as numpy's file format keeps it: a dtype numpy does not define itself
    (ml_dtypes' bfloat16) goes as unsigned integers of its width, read back as that dtype."""
    array = np.asarray(array)
    return array if array.dtype.isbuiltin == 1 else array.view(f"u{array.dtype.itemsize}")


class _Refused(ValueError):
    """A commit whose headers fail a check: tampered, not merely unreadable."""


#: the longest state text read (attributes are counters and small settings)
MAX_STATE_CHARS = 1 << 20
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}


def _expected(like: Sequence[np.ndarray]) -> dict:
    """Entry name -> (shape, stored dtype or None for the state text, the variable in words)
    of a commit of `like`."""
    entries = {_STATE: ((), None, "")}
    entries.update({f"v{index}": (np.shape(want), _stored(want).dtype,
                                  f"variable {index} of the state is {np.asarray(want).dtype} "
                                  f"of shape {np.shape(want)}")
                    for index, want in enumerate(like)})
    return entries


def _check_header(name: str, member, size: int, shape, dtype, variable: str) -> None:
    """One entry's .npy header against what the state expects, before its data is read.

    Raises:
        _Refused: another format version, shape, dtype or size (the message says which).
    """
    version = np.lib.format.read_magic(member)
    if version not in _HEADER_READERS:
        raise _Refused(f"{name} is in .npy format version {version}; expected 1.0 or 2.0")
    got_shape, _, got_dtype = _HEADER_READERS[version](member)
    if dtype is None:  # the state: one text of bounded length
        if got_shape != () or got_dtype.kind != "U" or got_dtype.itemsize > 4 * MAX_STATE_CHARS:
            raise _Refused(f"its {name} entry is a {got_dtype} array of shape {got_shape}, "
                           f"not one text of at most {MAX_STATE_CHARS} characters")
    elif got_shape != shape or got_dtype != dtype:
        raise _Refused(f"{name} is {got_dtype} of shape {got_shape}; {variable}")
    data = int(np.prod(got_shape, dtype=np.int64)) * got_dtype.itemsize
    if size != member.tell() + data:
        raise _Refused(f"{name} holds {size - member.tell()} bytes of data; its header says "
                       f"{data}")


def _read(path: str, like: Sequence[np.ndarray]) -> dict:
    """Every entry of a commit file, as arrays: the entries' names and every .npy header
    (shape, dtype, size) checked against the state's variables before any data is read,
    then numpy's loader, pickles refused. A planted file cannot make rank 0 allocate more than
    the state itself.

    Raises:
        _Refused: an entry or header that is not what :meth:`CommitStore.save` writes.
        OSError, ValueError, EOFError, zipfile.BadZipFile: the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        expected = _expected(like)
        with zipfile.ZipFile(f) as archive:
            members = archive.infolist()
            names = [member.filename[:-4] if member.filename.endswith(".npy")
                     else member.filename for member in members]
            if sorted(names) != sorted(expected):
                raise _Refused(f"it holds the entries {sorted(names)}, expected "
                               f"{sorted(expected)} (the state's {len(like)} variables and its "
                               f"state)")
            for name, member in zip(names, members):
                with archive.open(member) as stream:
                    _check_header(name, stream, member.file_size, *expected[name])
        f.seek(0)
        with np.load(f, allow_pickle=False) as store:
            return {name: store[name] for name in store.files}


def _checked(entries: dict, check_attributes, like) -> Loaded:
    """A commit's entries (their headers checked by :func:`_read`) read as data: its state,
    its attributes, its arrays.

    Raises:
        ValueError: a state that is not what :meth:`CommitStore.save` writes (JSON nested too
            deep, NaN or Infinity included), attributes the state's own check refuses.
    """
    state = checked_state(str(entries[_STATE]), (_ATTRIBUTES,))
    attributes = check_attributes(state.get(_ATTRIBUTES, {}))
    arrays = []
    for index, want in enumerate(like):
        got = entries[f"v{index}"]
        arrays.append(got if got.dtype == want.dtype else got.view(want.dtype))
    return int(state.get("size") or size()), attributes, arrays
