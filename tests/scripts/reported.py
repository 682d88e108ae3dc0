"""What the rank scripts write into their JSON reports: values as plain lists, and a call's
error as [type name, message] (the tests compare both by hand)."""

import numpy as np


def plain(value):
    """`value` (arrays, tensors, nested dicts/lists of them) as JSON-ready Python values."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return np.asarray(value).tolist()


def error_of(call):
    """[type name, message] of what `call()` raised, or None when it returned."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the report names whatever was raised
        return [type(error).__name__, str(error)]
    return None
