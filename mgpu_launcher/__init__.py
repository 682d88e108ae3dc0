"""The ``mgpu-train`` launcher. Imports no deep-learning framework.

Modules:
    cli           command line -> Config: parsing and checks only
    api           Config, the mpirun command, launch(): worker mode, elastic, or fixed hosts
                  with restarts; mgpu_launch.run's single supervised attempt
    restarts      what every restart shares: each attempt's variables, when not to restart
    environments  rank / size / local rank from Open MPI, MPICH/Intel MPI, Slurm, torchrun
    devices       visible GPUs; pinning one per worker
    mpirun        finding mpirun, its MPI flavour, building its argument list
    supervisor    running mpirun, signals, tearing the job down; how it ended (Outcome)
    relay         rank-tagged output to the console and per-rank logs, the failure summary
    sessions      a job's process session: members, killing it, a reaper if the caller dies
    elastic       --host-discovery-script: the loop that restarts the job as hosts change
    elastic_failures  which failures of an elastic job blacklist a host, which end it
    discovery     running and checking the discovery script; the host blacklist
    hostlists     the one reader of host lists (discovery output, hostfiles)
    hostfiles     --hostfile and the MPI Operator's hostfile: which hosts, how many slots
    merge         rank output: the same stderr line from several ranks shown once
    usage         the checks of the command line (UsageError, exit status 2)
    worker        running the user's program in-process as one rank
    foreign       Keras's and torchrun's variables for scripts written for them: the
                  coordinator agreed before the program runs (docs/starting-processes.md)
    envreport     ``mgpu-train --env``
    settings      every MGPU_* variable (declared in _settings_table): checked readers, the
                  start-up check, ``--env``'s listing, docs/settings.md

Environment each worker's program receives (besides what its MPI launcher sets):

    MGPU_RANK, MGPU_SIZE             global rank and number of processes
    MGPU_LOCAL_RANK, MGPU_LOCAL_SIZE rank and number of processes on this host
    MGPU_ENVIRONMENT                 which launcher was detected (openmpi, mpich, slurm,
                                     torchrun, jax-variables, single)
    MGPU_GPU                         id of the GPU pinned to this process (only with GPUs)
    MGPU_LOCAL_DEVICE                its index among the host's visible GPUs (only with GPUs)
    CUDA_VISIBLE_DEVICES             = MGPU_GPU, except for KERAS_BACKEND=jax, which must see
                                     every GPU (the runtime passes local_device_ids instead)

In standalone mode also:

    MGPU_MARKER_KEY                  a random key of this job: the lines a rank prints for
                                     mgpu-train (mgpu_launch.config.markers) carry it, so a
                                     rank's own text is never taken for one

For scripts written for other launchers (mgpu_launcher.foreign; not when torchrun started the
ranks, and not over values a user set):

    KERAS_DISTRIBUTION_JOB_ADDRESSES  one HOST:PORT per process, the coordinator (rank 0's
                                     host, a free port) first: keras.distribution.initialize()
    KERAS_DISTRIBUTION_NUM_PROCESSES, KERAS_DISTRIBUTION_PROCESS_ID  = size, rank
    WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE  torchrun's names for size, rank, local ones
    GROUP_RANK, GROUP_WORLD_SIZE     this host's index and the number of hosts (when known)
    MASTER_ADDR, MASTER_PORT         the coordinator again, for init_process_group's env://
    JAX_COORDINATOR_BIND_ADDRESS     where JAX's coordinator binds: its own address, not [::]
    JAX_LOCAL_DEVICE_IDS             (JAX ranks with GPUs) = MGPU_LOCAL_DEVICE, its one GPU
    GLOO_SOCKET_IFNAME               (several hosts) the interface the other hosts can dial
    MGPU_COORDINATOR                 (standalone, one host) 127.0.0.1:PORT, a port mgpu-train
                                     holds while it runs; elsewhere the ranks agree over MPI

In standalone mode with restarts (``mgpu-train -np N --max-restarts M``, M > 0) also:

    MGPU_RESTART_COUNT               0 for the first attempt, 1 after the first restart, ...
                                     (``--max-restarts``)
    MGPU_PROGRESS_MARKER             1: rank 0 prints markers.PROGRESS_MARKER after its first
                                     training step, so a failure after it is worth a restart

In elastic mode (``--host-discovery-script``; mgpu_launcher.elastic) also MGPU_ELASTIC=1: the
worker notes SIGUSR1 (mgpu-train asking for a stop at the next backup point, to resize).

In standalone mode, mpirun also forwards PATH, LD_LIBRARY_PATH, PYTHONPATH, KERAS_BACKEND,
KERAS_HOME, VIRTUAL_ENV, every MGPU_*, NCCL_*, XLA_*, TF_*, JAX_*, CUDA_*, OMP_* variable that
is set, and each ``-x VAR``.
"""

from mgpu_launch.config import __version__  # noqa: F401 (one version for both packages)
