"""A job's result file (``logs/<job>.json``), read back: the one place mgpu-bench trusts it.

Every result mgpu-bench puts into ``results.json``, ``results.md`` and the plot, a fresh one
or one ``--resume`` reuses, passes :func:`read` first: a regular file of this user (no link,
no FIFO, at most :data:`MAX_BYTES`), JSON of bounded depth without NaN / Infinity, and every
field the tables show checked for its type and range, text fields for plain characters (no
``|``, no line breaks, no markdown), so what another user could plant never reaches
``results.md`` as lines of its own. Past this point the result is data mgpu-bench made.
"""

import hashlib
import math
import re
from typing import Any, Dict, Tuple

from mgpu_launch.backends.reduction import STEP_PATHS
from mgpu_launch.bench.models import MODELS
from mgpu_launch.bench.worker import DATA_FORMATS
from mgpu_launch.runtime import folders

DATA_MODES = ("device", "host", "host-uint8", "numpy", "recipe")
#: what a row's ``rate`` counts (``models.BenchModel.unit``)
UNITS = ("img/s", "samples/s", "tokens/s")
#: the largest result file read (a job of 64 rows with per-rank figures of 4096 ranks fits)
MAX_BYTES = 16 << 20
MAX_RANKS = 4096
#: what a text field may hold: names, versions, device names
_TEXT = re.compile(r"[A-Za-z0-9 _.,:;=+()/@#%~-]{0,200}\Z")
PROFILE_COLUMNS = ("input_ms", "wait_ms", "step_ms", "own_ms", "compute_ms", "comm_ms")


class BadResult(ValueError):
    """A result file that is not one a bench job of this user wrote."""


def check_text(value: Any, where: str) -> str:
    """`value` if it is a short plain text (see :data:`_TEXT`).

    Raises:
        BadResult: it is not, with what it held.
    """
    if not isinstance(value, str) or not _TEXT.match(value):
        raise BadResult(f"{where}: expected a short plain text (letters, digits, spaces and "
                        f".,:;=+()/@#%~-), got {str(value)[:80]!r}")
    return value


def _number(value: Any, where: str, low: float = 0, high: float = 1e15) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not low <= value <= high):
        raise BadResult(f"{where}: expected a finite number in [{low:g}, {high:g}], got "
                        f"{str(value)[:80]!r}")
    return value


def _integer(value: Any, where: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadResult(f"{where}: expected an integer in [{low}, {high}], got "
                        f"{str(value)[:80]!r}")
    return value


def _one_of(value: Any, allowed, where: str) -> str:
    if value not in allowed:
        raise BadResult(f"{where}: expected one of {', '.join(allowed)}, got {str(value)[:80]!r}")
    return value


def _row(row: Any, where: str) -> Dict[str, Any]:
    if not isinstance(row, dict):
        raise BadResult(f"{where}: expected an object, got {type(row).__name__}")
    _one_of(row.get("model"), MODELS, f"{where} model")
    _one_of(row.get("data"), DATA_MODES, f"{where} data")
    _one_of(row.get("data_format"), DATA_FORMATS, f"{where} data_format")
    if row.get("prefetch") is not None:
        _integer(row["prefetch"], f"{where} prefetch", 0, 1 << 20)
    if row.get("variant") is not None:
        check_text(row["variant"], f"{where} variant")
    _integer(row.get("batch_per_gpu"), f"{where} batch_per_gpu", 1, 1 << 30)
    _number(row.get("img_per_sec"), f"{where} img_per_sec")
    per_rank = row.get("per_rank_img_per_sec")
    if not isinstance(per_rank, list) or not 1 <= len(per_rank) <= MAX_RANKS:
        raise BadResult(f"{where} per_rank_img_per_sec: expected a list of 1 to {MAX_RANKS} "
                        f"numbers")
    for rank, rate in enumerate(per_rank):
        _number(rate, f"{where} per_rank_img_per_sec[{rank}]")
    if "unit" in row or "rate" in row:  # rows of results older than the units have neither
        _one_of(row.get("unit"), UNITS, f"{where} unit")
        _number(row.get("rate"), f"{where} rate")
    if row.get("tokens_per_sample") is not None:
        _integer(row["tokens_per_sample"], f"{where} tokens_per_sample", 1, 1 << 30)
    for key in ("first_step_s", "warmup_s"):  # warmup_s: absent before it existed
        if row.get(key) is not None:
            _number(row[key], f"{where} {key}", high=1e7)
    if row.get("ready_step") is not None:
        _integer(row["ready_step"], f"{where} ready_step", 1, 1 << 40)
    if row.get("step_path") is not None:  # older rows: only `compiled` (the --compile flag)
        _one_of(row["step_path"], STEP_PATHS, f"{where} step_path")
    fallback = row.get("step_fallback")  # the fallback line's reason: kept, never shown
    if fallback is not None and (not isinstance(fallback, str) or len(fallback) > 2000):
        raise BadResult(f"{where} step_fallback: expected null or a text of at most 2000 "
                        f"characters, got {str(fallback)[:80]!r}")
    state = row.get("optimizer_state_bytes")
    if state is not None:
        if not isinstance(state, list) or not 1 <= len(state) <= MAX_RANKS:
            raise BadResult(f"{where} optimizer_state_bytes: expected a list of 1 to "
                            f"{MAX_RANKS} integers")
        for rank, held in enumerate(state):
            _integer(held, f"{where} optimizer_state_bytes[{rank}]", 0, 1 << 50)
    for key in ("cuda_graph", "recorder", "compiled", "shard_optimizer_state"):
        if key in row and not isinstance(row[key], bool):
            raise BadResult(f"{where} {key}: expected true or false, got {str(row[key])[:80]!r}")
    steps = row.get("cuda_graph_steps") or {}
    if not isinstance(steps, dict):
        raise BadResult(f"{where} cuda_graph_steps: expected an object")
    for name, count in steps.items():
        _integer(count, f"{where} cuda_graph_steps {check_text(name, where)}", 0, 1 << 62)
    profile = row.get("per_rank_profile")
    if profile is not None:
        if not isinstance(profile, list) or len(profile) > MAX_RANKS:
            raise BadResult(f"{where} per_rank_profile: expected a list of at most {MAX_RANKS}")
        for rank, columns in enumerate(profile):
            if not isinstance(columns, dict):
                raise BadResult(f"{where} per_rank_profile[{rank}]: expected an object")
            for name, value in columns.items():
                _one_of(name, PROFILE_COLUMNS, f"{where} per_rank_profile[{rank}] column")
                if value is not None:
                    _number(value, f"{where} per_rank_profile[{rank}] {name}")
    return row


def check(document: Any, what: str) -> Dict[str, Any]:
    """`document` if it is a result as the bench workers write it, every shown field checked.

    Raises:
        BadResult: (a ValueError) the first field that is wrong, what it held and what was
            expected.
    """
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list):
        raise BadResult(f"{what}: expected an object with a 'rows' list")
    if not 1 <= len(document["rows"]) <= 1024:
        raise BadResult(f"{what}: expected 1 to 1024 rows, got {len(document['rows'])}")
    for number, row in enumerate(document["rows"]):
        _row(row, f"{what} row {number}")
    if document.get("device") is not None:
        check_text(document["device"], f"{what} device")
    versions = document.get("versions") or {}
    if not isinstance(versions, dict) or len(versions) > 64:
        raise BadResult(f"{what} versions: expected an object of at most 64 names")
    for name, version in versions.items():
        check_text(version, f"{what} versions {check_text(name, f'{what} versions')}")
    return document


def read(path: str) -> Tuple[Dict[str, Any], str]:
    """A job's result file, checked (see the module docstring), and the SHA-256 of its bytes.

    Returns:
        (the document, its digest in hex): ``results.json`` records the digest, and
        ``--resume`` reuses only a file with the recorded digest.

    Raises:
        BadResult: it is not a result of a bench job (the message says what is wrong).
        PermissionError: it belongs to another user.
        OSError: it cannot be read (e.g. it is missing: the job wrote none).
    """
    try:
        data = folders.read_regular(path, MAX_BYTES, "the job's result", owned=True)
        return check(folders.load_json(data, path), path), hashlib.sha256(data).hexdigest()
    except BadResult:
        raise
    except ValueError as error:
        raise BadResult(str(error)) from None
