"""Loading a model saved from a DistributedOptimizer model: ``mgpu.load_model``.

A saved file holds the inner optimizer (so plain Keras loads it) and, in a ``.keras`` file, the
wrapper's settings under the optimizer's ``mgpu_launch`` key
(:meth:`~mgpu_launch.training.optimizer.DistributedOptimizer.get_config`); loading re-wraps.
"""

import json
import os
import zipfile
from typing import Optional

import keras

from mgpu_launch.training.optimizer import DistributedOptimizer


def load_model(path: str, custom_objects: Optional[dict] = None, **kwargs):
    """``keras.models.load_model`` that leaves the model's optimizer a DistributedOptimizer.

    Files saved from a DistributedOptimizer model hold the inner optimizer (so plain Keras
    loads them) and, in a ``.keras`` file, the wrapper's settings: the model comes back with a
    DistributedOptimizer of those settings around the loaded optimizer and its state. A model
    saved from plain single-process training gets its optimizer wrapped (default arguments).

    Args:
        path: a ``.keras`` file (or a legacy ``.h5``).
        custom_objects: as for ``keras.models.load_model``.
        **kwargs: passed to ``keras.models.load_model``.

    Returns:
        The model, its optimizer a DistributedOptimizer.

    Example:
        >>> model = mgpu.load_model("ckpt/model-05.keras")
        >>> model.fit(x, y, initial_epoch=5, epochs=10)
    """
    model = keras.models.load_model(path, custom_objects=custom_objects, **kwargs)
    if getattr(model, "optimizer", None) is not None and not isinstance(
            model.optimizer, DistributedOptimizer):
        model.optimizer = DistributedOptimizer.from_settings(model.optimizer,
                                                             saved_settings(path))
    return model


def saved_settings(path) -> dict:
    """The DistributedOptimizer settings a ``.keras`` file was saved with ({} if none)."""
    path = os.fspath(path)
    if not path.endswith(".keras") or not zipfile.is_zipfile(path):
        return {}
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    optimizer = (config.get("compile_config") or {}).get("optimizer")
    if not isinstance(optimizer, dict):
        return {}
    return dict((optimizer.get("mgpu_launch") or {}).get("config") or {})
