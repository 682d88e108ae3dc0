"""GPUs visible to this process, and pinning one of them to a worker — without importing CUDA.

Pinning differs by Keras backend (see DESIGN.md): TensorFlow and torch get
``CUDA_VISIBLE_DEVICES=<gpu>``; JAX must keep every GPU visible (per-process
CUDA_VISIBLE_DEVICES hangs jax.distributed's topology exchange), so it gets
``MGPU_LOCAL_DEVICE=<local_rank>`` and the runtime passes ``local_device_ids`` to JAX. Which
rule a backend follows is one of its facts (``mgpu_launch/backends/<name>/__init__.py``); the
launcher hands it to :func:`pin_gpu`, which knows no backend by name.
"""

import json
import os
import shutil
import subprocess
from typing import List, Mapping, MutableMapping, Optional

PROC_GPUS = "/proc/driver/nvidia/gpus"


class PinningError(ValueError):
    """The GPUs of this host cannot be shared out among its workers as asked."""


def visible_gpus(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """IDs of the GPUs this process may use, as CUDA_VISIBLE_DEVICES would name them.

    Reads CUDA_VISIBLE_DEVICES when set; otherwise counts the NVIDIA driver's GPUs
    (/proc, then ``nvidia-smi -L``). Returns [] on a machine without NVIDIA GPUs.
    """
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [item.strip() for item in listed.split(",") if item.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
        return [] if not ids or ids[0].startswith("-") else ids
    if os.path.isdir(PROC_GPUS):
        return [str(i) for i in range(len(os.listdir(PROC_GPUS)))]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU"))]
    return []


def keras_backend(environ: Optional[Mapping[str, str]] = None) -> str:
    """The Keras backend a worker will use, found the way Keras finds it, without importing it."""
    environ = os.environ if environ is None else environ
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    keras_home = environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(keras_home, "keras.json")) as config:
            return json.load(config).get("backend", "tensorflow")
    except (OSError, ValueError):
        return "tensorflow"


def pin_gpu(local_rank: int, local_size: int, environ: MutableMapping[str, str], *,
            by_visible_devices: bool = True) -> Optional[str]:
    """Give this worker GPU number `local_rank` of the visible ones; return its id (None: no GPU).

    Sets MGPU_GPU (the id) and MGPU_LOCAL_DEVICE (the index among the visible GPUs) always,
    and CUDA_VISIBLE_DEVICES where `by_visible_devices` (the backend's facts say which: their
    ``pins_by_visible_devices``, ``mgpu_launch.backends.facts.BackendFacts``; False for JAX).

    Raises:
        PinningError: more workers on this host than visible GPUs.
    """
    gpus = visible_gpus(environ)
    if not gpus:
        return None
    if local_size > len(gpus):
        raise PinningError(
            f"{local_size} workers on this host but only {len(gpus)} visible GPU(s) "
            f"({','.join(gpus)}): start at most {len(gpus)} processes per host, or pass "
            f"--no-pin to place them yourself")
    gpu = gpus[local_rank]
    environ["MGPU_GPU"] = gpu
    environ["MGPU_LOCAL_DEVICE"] = str(local_rank)
    if by_visible_devices:
        environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu
