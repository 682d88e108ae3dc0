"""Rank detection: each launcher's variables, the priority order, and bad input."""

import pytest

from mgpu_launch.config.environments import (SINGLE_PROCESS, DetectionError, detect,
                                   expand_tasks_per_node)

OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
PMI = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
         "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x2),3"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
JAX = {"JAX_PROCESS_ID": "2", "JAX_NUM_PROCESSES": "3"}


@pytest.mark.parametrize("environ, expected", [
    (OMPI, (3, 4, 1, 2, "openmpi")),
    (PMI, (2, 4, 0, 2, "mpich")),
    (SLURM, (5, 7, 0, 3, "slurm")),
    (TORCHRUN, (1, 2, 1, 2, "torchrun")),
    # JAX's variables name no local rank: every process counts as this host's until
    # mgpu.init() groups them by host over the control plane
    (JAX, (2, 3, 2, 3, "jax-variables")),
    ({}, (0, 1, 0, 1, "single")),
])
def test_each_environment(environ, expected):
    found = detect(environ)
    assert (found.rank, found.size, found.local_rank, found.local_size, found.source) == expected


def test_nothing_set_is_a_single_process():
    assert detect({"HOME": "/root"}) == SINGLE_PROCESS


def test_mpi_beats_slurm_variables_inherited_from_the_batch_script():
    # mpirun inside sbatch: every rank inherits the batch step's SLURM_PROCID=0 (no step id).
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    assert detect({**batch, **OMPI}).source == "openmpi"
    assert detect({**batch, **OMPI}).rank == 3


def test_priority_order_openmpi_mpich_slurm_torchrun():
    consistent_pmi = {**PMI, "PMI_RANK": "3"}  # same job as OMPI: rank 3 of 4
    assert detect({**TORCHRUN, **SLURM, **consistent_pmi, **OMPI}).source == "openmpi"
    assert detect({**TORCHRUN, "PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                   "MPI_LOCALNRANKS": "2"}).source == "mpich"
    assert detect({**SLURM, "RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "3"}).source == "slurm"


def test_slurm_batch_script_without_step_is_not_a_job_step():
    assert detect({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}) == SINGLE_PROCESS


def test_contradiction_between_environments_names_both():
    environ = {**OMPI, "PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0",
               "MPI_LOCALNRANKS": "2"}
    with pytest.raises(DetectionError, match=r"OMPI_COMM_WORLD_RANK.*PMI_RANK"):
        detect(environ)


@pytest.mark.parametrize("change, message", [
    ({"OMPI_COMM_WORLD_RANK": "4"}, r"OMPI_COMM_WORLD_RANK=4 is not in \[0, OMPI_COMM_WORLD_SIZE=4\)"),
    ({"OMPI_COMM_WORLD_RANK": "x"}, r"OMPI_COMM_WORLD_RANK='x' is not an integer"),
    ({"OMPI_COMM_WORLD_SIZE": "0"}, r"must be at least 1"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "5"}, r"OMPI_COMM_WORLD_LOCAL_SIZE=5 is not in \[1,"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, r"OMPI_COMM_WORLD_LOCAL_RANK=2 is not in \[0,"),
])
def test_malformed_values_are_named(change, message):
    with pytest.raises(DetectionError, match=message):
        detect({**OMPI, **change})


def test_missing_companion_variable_is_named():
    environ = dict(PMI)
    del environ["PMI_SIZE"]
    with pytest.raises(DetectionError, match="PMI_SIZE is not set"):
        detect(environ)


@pytest.mark.parametrize("spec, expected", [
    ("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,2(x2)", [1, 2, 2]),
])
def test_slurm_tasks_per_node(spec, expected):
    assert list(expand_tasks_per_node(spec)) == expected


@pytest.mark.parametrize("spec", ["", "two", "2(xz)"])
def test_slurm_tasks_per_node_bad(spec):
    with pytest.raises(DetectionError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node(spec)


def test_srun_pmi2_variables_are_slurms_not_mpichs():
    # Task 1 of `srun -n 2 --mpi=pmi2 env` on Slurm 22.05 (scripts/slurm.sh), as printed there.
    environ = {"PMI_FD": "13", "PMI_JOBID": "5.0", "PMI_RANK": "1", "PMI_SIZE": "2",
               "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
               "SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2"}
    found = detect(environ)
    assert (found.rank, found.size, found.local_rank, found.local_size, found.source) == \
        (1, 2, 1, 2, "slurm")


# -- the control plane each environment names (JAX's ClusterEnv shape: + coordinator address) --
MASTER = {"MASTER_ADDR": "node1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("environ, expected", [
    (OMPI, ("mpi", None)),
    (PMI, ("mpi", None)),
    (SLURM, ("mpi", None)),
    ({**TORCHRUN, **MASTER}, ("torch.distributed", "node1:29500")),
    ({**TORCHRUN, "MASTER_ADDR": "fd00::1", "MASTER_PORT": "29500"}, ("torch.distributed", "[fd00::1]:29500")),
    (TORCHRUN, ("torch.distributed", None)),                                  # no coordinator named
    ({**TORCHRUN, "MASTER_ADDR": "node1"}, ("torch.distributed", None)),      # half of one
    ({**TORCHRUN, **MASTER, "MASTER_PORT": "port"}, ("torch.distributed", None)),
    ({**OMPI, **MASTER}, ("mpi", None)),                          # MPI's ranks need none
    ({**JAX, "JAX_COORDINATOR_ADDRESS": "node1:1234"}, ("jax.distributed", "node1:1234")),
    (JAX, ("jax.distributed", None)),
    ({**JAX, "JAX_COORDINATOR_ADDRESS": "node1"}, ("jax.distributed", None)),
    ({**TORCHRUN, **MASTER, **JAX, "JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2"},
     ("torch.distributed", "node1:29500")),                       # torchrun's come first
    ({}, (None, None)),                                           # one process talks to no one
])
def test_each_environment_names_its_control_plane_and_coordinator(environ, expected):
    found = detect(environ)
    assert (found.control_plane, found.coordinator_address) == expected


def test_a_stray_coordinator_variable_fails_no_mpi_job():
    # torchrun's names beside Open MPI's (RANK left over from an outer tool): MPI still wins,
    # and the torchrun placement that is read alongside does not fail on MASTER_PORT
    environ = {**OMPI, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
               "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "not a port"}
    assert detect(environ).source == "openmpi"
