"""Folders mgpu writes into and reads back from: nobody but their owner may change them.

Part of the trust boundary (:mod:`mgpu_launch.runtime.auth`): ``mgpu_launch.run``'s work
folder, ``BackupAndRestore``'s backup folder and ``hvd.elastic``'s state folder pass
:func:`private_folder` before mgpu writes or reads anything there, and files are created
only through :func:`create_new` / :func:`replace_file` (``O_EXCL | O_NOFOLLOW``), so a link
someone planted is never written through. Files read back that another user may have planted
(``mgpu-bench --resume``'s results, ``trace_files merge``'s inputs, the elastic and backup
states) go through :func:`read_regular` (a regular file, no link, bounded size) and
:func:`load_json` (bounded depth, no NaN) before anything parses them further.

Why every component of the path: whoever may rename an entry of any folder on the way (a
folder of theirs, or one everybody may write in without the sticky bit), or owns a symbolic
link on the way, decides where the path leads, and with it which files mgpu reads or
overwrites. A folder is therefore private when

- it is a folder owned by this process's user, and neither its group nor others may write in
  it (they could plant files that mgpu then loads, or links it writes through);
- every folder on its path, the ones symbolic links lead through included, is owned by this
  user or by root, and its group and others may not write in it unless its sticky bit is set
  (as on ``/tmp``: then they cannot rename or delete entries that are not theirs);
- every symbolic link on the way is owned by this user or by root.

This module imports no deep-learning framework.
"""

import errno
import json
import os
import re
import shutil
import stat
import warnings
from typing import List, Optional, Tuple

_MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup


#: how to fix an :class:`UnsafeFolder`, when the caller has no better advice
FIX = ("Use a folder of your own that only you may write in, on a path only you or root may "
       "change (a missing folder is created with mode 0700)")


class UnsafeFolder(PermissionError):
    """A folder another user could change (see the module docstring).

    Attributes:
        problem: which folder and what is wrong, in words (the message adds how to fix it).
    """

    def __init__(self, problem: str, fix: str = FIX):
        super().__init__(f"{problem}. {fix}")
        self.problem = problem


def _trusted(uid: int) -> bool:
    return uid in (0, os.geteuid())


def _owner(uid: int) -> str:
    return f"uid {uid}; you are uid {os.geteuid()}"


def _component_problem(path: str, info: os.stat_result) -> Optional[str]:
    """Why a folder on the way lets another user redirect what lies below it, or None."""
    mode = stat.S_IMODE(info.st_mode)
    if not _trusted(info.st_uid):
        return (f"the folder {path!r} on its path belongs to another user ({_owner(info.st_uid)}), "
                f"who could swap what lies below it")
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        return (f"the folder {path!r} on its path is writable by its group or by every user "
                f"without the sticky bit (mode {mode:04o}), so they could swap what lies below it "
                f"(fix with chmod go-w or chmod +t)")
    return None


def _leaf_problem(info: os.stat_result) -> Optional[str]:
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.geteuid():
        return f"belongs to another user ({_owner(info.st_uid)})"
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"is writable by its group or by every user (mode {mode:04o}; fix with "
                f"chmod go-w)")
    return None


def _resolve(path: str) -> Tuple[List[str], Optional[str]]:
    """(the real folders `path` leads through, outermost first, up to its last existing entry;
    why another user could redirect it, or None)."""
    pending = [part for part in path.split("/") if part]
    current, walked, links = "/", ["/"], 0
    problem = _component_problem("/", os.lstat("/")) if pending else None
    while pending and problem is None:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)  # `current` holds no links: this is exact
            continue
        candidate = os.path.join(current, name)
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            break  # the rest does not exist yet
        if stat.S_ISLNK(info.st_mode):
            links += 1
            target = os.readlink(candidate)
            if not _trusted(info.st_uid):
                problem = (f"it passes through the symbolic link {candidate!r} (to {target!r}), "
                           f"which belongs to another user ({_owner(info.st_uid)}), who could "
                           f"point it elsewhere")
            elif links > _MAX_LINKS:
                problem = f"it passes through more than {_MAX_LINKS} symbolic links"
            pending = [part for part in target.split("/") if part] + pending
            if target.startswith("/"):
                current = "/"
            continue
        current = candidate
        walked.append(current)
        if pending and not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", current)
        if pending:
            problem = _component_problem(current, info)
    return walked, problem


def private_folder(path: str, what: str = "folder", create: bool = True) -> str:
    """Check that only this user can change `path` and what it holds; create it if missing.

    Args:
        path: the folder (relative paths are taken from the working folder).
        what: what the folder is, for the message (e.g. ``"work_dir"``, ``"backup_dir"``).
        create: create the folder and any missing parents (mode 0700) when missing.

    Returns:
        The folder's real absolute path (no links): open its files through this.

    Raises:
        UnsafeFolder: (a PermissionError) another user could change the folder or its path;
            the message names the folder, what is wrong and how to fix it.
        FileNotFoundError: it does not exist and `create` is False.
        FileExistsError: it exists and is not a folder.
        NotADirectoryError: something on its path is a file, not a folder.

    Example:
        >>> folder = private_folder("/scratch/job-42/backup", "backup_dir")
    """
    absolute = os.path.abspath(path)
    walked, problem = _resolve(absolute)
    real = os.path.realpath(absolute)
    if problem is None and walked[-1] != real:  # something is missing: make it, look again
        if not create:
            raise FileNotFoundError(f"{what} {path!r} does not exist")
        missing = []
        while not os.path.lexists(real):
            missing.append(real)
            real = os.path.dirname(real)
        for folder in reversed(missing):
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass  # made meanwhile by someone: the checks below decide whether it will do
        walked, problem = _resolve(absolute)
        real = os.path.realpath(absolute)
    at = f" (that is {real!r})" if real != absolute else ""
    if problem is None and not os.path.isdir(real):
        raise FileExistsError(errno.EEXIST, f"{what} {path!r}{at} exists and is not a folder")
    if problem is not None:
        problem = f"is not private: {problem}"
    else:
        problem = _leaf_problem(os.lstat(real))
    if problem is not None:
        raise UnsafeFolder(f"{what} {path!r}{at} {problem}")
    return real


def remove_private(path: str, what: str, who: str, holding: str) -> None:
    """Delete the folder `path` and all it holds, unless another user could have redirected it
    (then warn and leave it); a missing folder is nothing to do.

    Args:
        path: the folder (e.g. a backup_dir at the end of training).
        what: what the folder is, for :func:`private_folder`'s checks.
        who, holding: for the warning: who deletes it and what it holds.

    Example:
        >>> remove_private("/scratch/job-42/backup", "backup_dir", "BackupAndRestore",
        ...                "the backups")
    """
    try:
        folder = private_folder(path, what, create=False)
    except FileNotFoundError:
        return
    except UnsafeFolder as error:
        warnings.warn(f"{who}: not deleting {holding}: {error}", stacklevel=3)
        return
    shutil.rmtree(folder, ignore_errors=True)


def open_new(path: str, mode: int = 0o600, text: bool = False):
    """Open a new file for writing (`mode`, less the umask); fails on anything already there,
    a symbolic link included.

    Returns:
        The file object (binary, or text when `text`).

    Raises:
        FileExistsError: `path` exists (a file, a folder or a link: nothing is followed).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, mode), "w" if text else "wb")


def create_new(path: str, data: bytes = b"", mode: int = 0o600) -> None:
    """Write a new file (`mode`, less the umask); fails on anything already there, a symbolic
    link included.

    Raises:
        FileExistsError: `path` exists (a file, a folder or a link: nothing is followed).
    """
    with open_new(path, mode) as f:
        f.write(data)


def replace_file(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write `path` whole and at once: a new private file beside it (:func:`create_new`), then
    renamed over it, so a link planted at either name is replaced, never written through, and
    a crash leaves the old file or the new one, never a truncated one.

    Raises:
        OSError: the folder cannot be written in.
    """
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.{os.urandom(6).hex()}.tmp")
    create_new(temporary, data, mode)
    try:
        os.replace(temporary, path)
    except OSError:
        os.unlink(temporary)
        raise


def read_regular(path: str, limit: int, what: str = "file", owned: bool = False) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, not through a symbolic link.

    For files other users may have planted or replaced: a link, a FIFO, a device (``/dev/zero``)
    or a file larger than `limit` is refused before anything is read, and the read stops at
    `limit` bytes whatever the file does meanwhile.

    Args:
        path: the file.
        limit: the most bytes accepted.
        what: what the file is, for the message.
        owned: also refuse a file that belongs to another user (nor root).

    Raises:
        UnsafeFolder: (a PermissionError) `owned` and the file belongs to another user.
        ValueError: it is a link, not a regular file, or larger than `limit`.
        OSError: it cannot be opened.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(f"{what} {path!r} is a symbolic link; expected a regular file "
                             f"(give the file it points to, if it is yours)") from None
        raise
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what} {path!r} is not a regular file (mode "
                             f"{stat.filemode(info.st_mode)}); expected a file")
        if owned and not _trusted(info.st_uid):
            raise UnsafeFolder(f"{what} {path!r} belongs to another user ({_owner(info.st_uid)})",
                               "Remove it or use another folder")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} {path!r} holds more than {limit} bytes; expected at most that")
    return data


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')  # JSON strings, escapes included
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows here")


def load_json(data: bytes, what: str, max_depth: int = 32):
    """Parse JSON read from a file another user may have written: nesting deeper than
    `max_depth` and NaN / Infinity are refused before they cost anything.

    Raises:
        ValueError: not UTF-8 JSON, nested too deep, or holding NaN / Infinity.
    """
    depth = 0
    brackets = _STRINGS.sub(b"", data).translate(None, _NOT_BRACKETS)
    for char in brackets:
        depth += 1 if char in b"[{" else -1
        if depth > max_depth:
            raise ValueError(f"{what} is refused: JSON nested deeper than {max_depth} levels; "
                             f"expected a file mgpu-launch wrote")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{what} is not JSON ({error})") from None
    except ValueError as error:  # NaN / Infinity (_refuse_constant)
        raise ValueError(f"{what} is refused: {error}") from None
