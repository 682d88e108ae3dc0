"""Checks of mgpu-train's command line, one small function per argument: each raises
:class:`UsageError` (printed as one line, exit status 2) saying what it received, what it
expected and an example. Used by :mod:`mgpu_launcher.cli`.
"""

import os
from typing import Optional, Sequence

from mgpu_launch import backends
from mgpu_launch.config import devices, settings
from mgpu_launcher import hostlists

PROG = "mgpu-train"
#: the Keras backends mgpu_launch has an engine for (the backends' registry, read without
#: importing any framework)
KERAS_BACKENDS = tuple(backends.BACKENDS)

class UsageError(Exception):
    """A bad command line: printed as one line, exit status 2."""


def parse_np(value: Optional[str]) -> Optional[int]:
    if value is None:
        return None
    if value == "auto":
        return max(1, len(devices.visible_gpus()))
    try:
        np = int(value)
    except ValueError:
        np = 0
    if np < 1:
        raise UsageError(f"-np {value!r}: expected a whole number of processes >= 1, or "
                         f"'auto' (one per visible GPU), e.g. -np 2")
    return np


def parse_max_restarts(value: Optional[str]) -> int:
    if value is None:
        return settings.integer("MGPU_MAX_RESTARTS")
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise UsageError(f"--max-restarts {value!r}: expected a whole number of restarts >= 0, "
                         f"e.g. --max-restarts 3")
    return count


def check_settings(forward: Sequence[str]) -> None:
    """Every MGPU_* variable (set here, or by -x NAME=VALUE) has a good value."""
    given = dict(item.partition("=")[::2] for item in forward if "=" in item)
    try:
        settings.check({**os.environ, **given})
    except settings.SettingError as error:
        raise UsageError(str(error)) from None


def parse_hosts(hosts: str) -> hostlists.HostSlots:
    """``-H``'s value as the job's hosts (mgpu_launcher.hostlists reads it; exit 2 if bad)."""
    try:
        return hostlists.parse_hosts(hosts)
    except ValueError as error:
        raise UsageError(str(error)) from None


def check_script(target: str) -> None:
    """A script path python could run: a file, or a folder with __main__.py (as python)."""
    if os.path.isdir(target):
        if not os.path.isfile(os.path.join(target, "__main__.py")):
            raise UsageError(f"can't run {target!r}: it is a directory (without __main__.py); "
                             f"expected a Python script, e.g. {PROG} -np 2 train.py, or "
                             f"-m module")
    elif not os.path.isfile(target):
        raise UsageError(f"can't open file {target!r}: no such file")


def check_keras_backend(forward: Sequence[str]) -> None:
    """KERAS_BACKEND (set here, or by -x KERAS_BACKEND=...) names a backend mgpu-launch runs."""
    value = os.environ.get("KERAS_BACKEND")
    for item in forward:
        name, has_value, given = item.partition("=")
        if name == "KERAS_BACKEND" and has_value:
            value = given
    if value is not None and value not in KERAS_BACKENDS and \
            settings.choice("MGPU_ENGINE") != "none":
        raise UsageError(f"KERAS_BACKEND={value!r} is not a backend mgpu-launch runs; expected "
                         f"one of {', '.join(KERAS_BACKENDS)}, e.g. KERAS_BACKEND=jax (unset, "
                         f"Keras uses tensorflow)")
