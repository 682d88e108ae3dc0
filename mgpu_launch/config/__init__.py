"""What configures a job, below every other layer: read by the launcher and the library alike.

Modules:
    settings        every ``MGPU_*`` variable: checked readers, the start-up check, listings
    settings_table  the declaration of each variable (name, kind, default, who reads it)
    environments    rank / size / local rank from Open MPI, MPICH/Intel MPI, Slurm, torchrun
    devices         visible GPUs; pinning one per worker
    markers         the lines a rank prints for its launcher; ending the whole job from a rank

Nothing here imports a framework, Keras, MPI or another part of mgpu: the launcher
(``mgpu_launcher``) sits above it and starts in a fraction of a second.
"""

__version__ = "0.1.0"
