"""Every ``MGPU_*`` environment variable, declared once: its type, default, help and reader.

    from mgpu_launch.config import settings
    settings.integer("MGPU_PREFETCH", fallback=2)   # a checked int, or SettingError

The declarations (:data:`SETTINGS`, in mgpu_launch.config.settings_table) are the one source:

* the typed readers here (:func:`integer`, :func:`number`, :func:`seconds`, :func:`flag`,
  :func:`choice`, :func:`text`) check every value against them;
* ``mgpu-train`` (both modes) and ``mgpu.init()`` check every ``MGPU_*`` variable of their
  environment at start-up (:func:`check`: a bad value is an error), and warn about an unknown
  name, naming the closest known one (:func:`warn_unknown`);
* ``mgpu-train --env`` lists them with their effective values (:func:`listing`);
* docs/settings.md is their table (``python -m mgpu_launch.config.settings --markdown``;
  tests/launcher/test_settings.py fails when the two disagree).

Rules shared by every variable: leading and trailing blanks are ignored, and an empty value
counts as unset (the default applies). Flags take ``1/0``, ``true/false``, ``yes/no`` and
``on/off`` in any case; choices any case.

This module is the launcher's, so it imports no framework and every layer may use it.
"""

import difflib
import os
import sys
import warnings
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple

from mgpu_launch.config.settings_table import (INTERNAL, LAUNCHER, PREFIX, RANKS, SETTINGS, TOOLING,
                                           Setting, SettingError, SettingWarning)

__all__ = ["SettingError", "SettingWarning", "Setting", "SETTINGS", "get", "integer", "number",
           "seconds", "flag", "choice", "text", "is_set", "check", "warn_unknown",
           "unknown_names", "listing", "markdown", "LAUNCHER", "RANKS", "INTERNAL", "TOOLING"]

_MISSING = object()
_warned = set()  # unknown names already warned about in this process


def _setting(name: str, kind: Optional[str] = None) -> Setting:
    try:
        setting = SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in mgpu_launch.config.settings_table; declare it "
                       f"there (name, type, default, help) before reading it") from None
    if kind is not None and setting.kind != kind and not (kind == "text" and
                                                          setting.kind in ("address", "ipv4")):
        raise TypeError(f"{name} is declared as {setting.kind}, read as {kind}")
    return setting


def get(name: str, environ: Optional[Mapping[str, str]] = None, fallback: Any = _MISSING,
        kind: Optional[str] = None) -> Any:
    """The checked value of the variable `name`, or its default when it is unset or empty.

    Args:
        name: a declared ``MGPU_*`` variable.
        environ: the variables to read (default: ``os.environ``).
        fallback: the value when unset, instead of the declared default (a default the caller
            computes, e.g. per backend).
        kind: check that the variable is declared with this type.

    Returns:
        The parsed value (int, float, bool, str) or the default.

    Raises:
        SettingError: the value does not parse; the message says what is expected.

    Example:
        >>> get("MGPU_TF_TRANSPORT", {"MGPU_TF_TRANSPORT": " MPI "})
        'mpi'
    """
    setting = _setting(name, kind)
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return setting.default if fallback is _MISSING else fallback
    return setting.parse(raw)


def _reader(kind: str) -> Callable[..., Any]:
    def read(name: str, environ: Optional[Mapping[str, str]] = None,
             fallback: Any = _MISSING) -> Any:
        return get(name, environ, fallback, kind)
    read.__name__ = read.__qualname__ = kind
    read.__doc__ = f"""The variable `name`, declared as {kind}: see :func:`get`.

    Raises:
        SettingError: naming the variable, the value, what is expected and an example.
        TypeError: `name` is declared with another type.
    """
    return read


integer = _reader("integer")
number = _reader("number")
seconds = _reader("seconds")
flag = _reader("flag")
choice = _reader("choice")
text = _reader("text")


def is_set(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether `name` has a (non-blank) value, i.e. its default does not apply."""
    _setting(name)
    return bool((os.environ if environ is None else environ).get(name, "").strip())


def unknown_names(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """One warning per ``MGPU_*`` variable of `environ` that is not declared (a typo?)."""
    environ = os.environ if environ is None else environ
    found = []
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in SETTINGS):
        close = difflib.get_close_matches(name, list(SETTINGS), n=1)
        hint = f"did you mean {close[0]}?" if close else "mgpu-train --env lists the known ones"
        found.append(f"{name} is not a setting of mgpu-launch and is ignored ({hint})")
    return found


def check(environ: Optional[Mapping[str, str]] = None) -> None:
    """Check the value of every declared ``MGPU_*`` variable of `environ` (default:
    ``os.environ``).

    Raises:
        SettingError: the first (by name) whose value does not parse.

    Example:
        >>> check({"MGPU_FUSION_MB": "big"})
        Traceback (most recent call last):
        SettingError: MGPU_FUSION_MB='big': expected a number of MiB >= 0, e.g. MGPU_FUSION_MB=64
    """
    environ = os.environ if environ is None else environ
    for name in sorted(n for n in environ if n in SETTINGS):
        get(name, environ)


def warn_unknown(environ: Optional[Mapping[str, str]] = None,
                 emit: Optional[Callable[[str], None]] = None) -> None:
    """Warn about each unknown ``MGPU_*`` name (:func:`unknown_names`) once per process.

    Args:
        environ: the variables (default: ``os.environ``).
        emit: called with each warning (default: ``warnings.warn``, a :class:`SettingWarning`).
    """
    for message in unknown_names(environ):
        if message not in _warned:
            _warned.add(message)
            if emit is None:
                warnings.warn(message, SettingWarning, stacklevel=2)
            else:
                emit(message)


def _effective(setting: Setting, environ: Mapping[str, str]) -> Tuple[str, str]:
    raw = environ.get(setting.name, "").strip()
    if not raw:
        return setting.shown_default or setting.shown(setting.default), "default"
    try:
        return setting.shown(setting.parse(raw)), "environment"
    except SettingError:
        return f"{raw!r} (INVALID)", "environment"


def listing(environ: Optional[Mapping[str, str]] = None) -> str:
    """``mgpu-train --env``'s settings: every variable a user may set, its effective value,
    where that came from (default / environment), its default and its help."""
    environ = os.environ if environ is None else environ
    lines = ["settings (MGPU_* variables; docs/settings.md):"]
    for setting in SETTINGS.values():
        if setting.reader not in (LAUNCHER, RANKS):
            continue
        value, source = _effective(setting, environ)
        if source != "default":
            source += f"; default {setting.shown_default or setting.shown(setting.default)}"
        line = f"  {setting.name:<28} = {value}  ({source})\n  {'':<28}   {setting.help}"
        lines.append(line.replace("`", ""))
    lines += unknown_names(environ)
    return "\n".join(lines)


_SECTIONS = ((LAUNCHER, "Read by `mgpu-train` (standalone mode, `-np N`)"),
             (RANKS, "Read in every rank (by `mgpu.init()`, the engines and the Keras glue)"),
             (INTERNAL, "Set by `mgpu-train` for its ranks (internal: read them, do not set "
                        "them)"),
             (TOOLING, "Read by the test suite and `scripts/` (not by the library)"))


def markdown() -> str:
    """docs/settings.md: the table of every variable, grouped by reader."""
    out = ["# Settings: the `MGPU_*` environment variables", "",
           "<!-- Generated by `python -m mgpu_launch.config.settings --markdown > docs/settings.md` "
           "from mgpu_launch/config/settings_table.py; tests/launcher/test_settings.py fails when they "
           "differ. -->",
           "", "Every variable is checked when `mgpu-train` starts (both modes) and in "
           "`mgpu.init()`: a bad value stops it with an error naming the variable, the value, "
           "what is expected and an example; an unknown `MGPU_*` name gets a warning naming the "
           "closest known one. Blanks around a value are ignored and an empty value counts as "
           "unset. `mgpu-train --env` lists the effective values. `mgpu-train` forwards every "
           "`MGPU_*` variable to every rank.", ""]
    for reader, title in _SECTIONS:
        out += [f"## {title}", "", "| Variable | Values | Default | What it does |",
                "|---|---|---|---|"]
        for setting in SETTINGS.values():
            if setting.reader == reader:
                default = setting.shown_default or setting.shown(setting.default)
                out.append(f"| `{setting.name}` | {setting.values()} | {default} | "
                           f"{setting.help} |")
        out.append("")
    return "\n".join(out)


def main(argv: Optional[Iterable[str]] = None) -> int:
    """``python -m mgpu_launch.config.settings [--markdown]``: the docs table, or the listing."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv not in ([], ["--markdown"]):
        print("usage: python -m mgpu_launch.config.settings [--markdown]", file=sys.stderr)
        return 2
    if argv:
        print(markdown(), end="")
    else:
        print(listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
