"""Runs under a real Slurm (Debian's slurmctld + slurmd + munge, started by scripts/slurm.sh).

What is checked: rank detection from the variables srun really sets (with each MPI plugin
``srun --mpi=list`` offers), direct launch ``srun --mpi=pmix mgpu-train`` with the Open MPI
that pip installs, the clear error when srun starts no MPI, and the example batch script
examples/cluster/slurm_train.sbatch run by ``sbatch`` with both of its launch lines.

Marked ``cluster``: needs root and scripts/install_cluster_deps.sh; FAILS when Slurm cannot
be started.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, SCRIPTS, daemons_up, explain, job_env

pytestmark = [pytest.mark.cluster, pytest.mark.job]

SLURM_SH = os.path.join(ROOT, "scripts", "slurm.sh")
SBATCH = os.path.join(ROOT, "examples", "cluster", "slurm_train.sbatch")
REPORT = os.path.join(SCRIPTS, "report.py")
TRAIN = os.path.join(SCRIPTS, "train.py")
DETECT = ("import json, os; from mgpu_launch.config import environments as e; p = e.detect(); "
          "print(json.dumps([p.rank, p.size, p.local_rank, p.local_size, p.source, "
          "os.environ.get('PMI_RANK')]))")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The environment of a running one-node Slurm (SLURM_CONF set); stopped after the session."""
    directory = tmp_path_factory.mktemp("slurm")
    with daemons_up(SLURM_SH, directory, "root and scripts/install_cluster_deps.sh"):
        yield job_env(SLURM_CONF=str(directory / "slurm.conf"))


def run(env, *argv, timeout=120, **extra):
    return subprocess.run(list(argv), cwd=ROOT, env={**env, **extra}, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("plugin", ["none", "pmi2", "pmix"])
def test_rank_detection_from_the_variables_srun_sets(slurm, plugin):
    result = run(slurm, "srun", "-n", "2", f"--mpi={plugin}", sys.executable, "-c", DETECT)
    assert result.returncode == 0, explain(result)
    found = sorted(json.loads(line)[:5] for line in result.stdout.splitlines())
    assert found == [[0, 2, 0, 2, "slurm"], [1, 2, 1, 2, "slurm"]], explain(result)


def test_srun_lists_the_pmix_plugin(slurm):
    result = run(slurm, "srun", "--mpi=list")
    assert "pmix" in result.stdout + result.stderr, explain(result)


def test_srun_pmix_starts_one_mpi_job(slurm, tmp_path):
    result = run(slurm, "srun", "-n", "2", "--mpi=pmix", "mgpu-train", REPORT, str(tmp_path),
                 MGPU_ENGINE="none")
    assert result.returncode == 0, explain(result)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        assert (report["rank"], report["size"], report["local_rank"]) == (rank, 2, rank)
        assert report["env"]["MGPU_ENVIRONMENT"] == "slurm"
        assert report["average"] == 1.5  # over MPI: both tasks are one job


def test_srun_without_pmix_is_refused_clearly(slurm, tmp_path):
    result = run(slurm, "srun", "-n", "2", "--mpi=none", "mgpu-train", REPORT, str(tmp_path),
                 MGPU_ENGINE="none")
    assert result.returncode != 0
    assert "slurm says this job has 2 processes but MPI's COMM_WORLD has 1" in result.stderr, \
        explain(result)
    assert "srun --mpi=pmix" in result.stderr


def sbatch(env, tmp_path, launch, *program, **extra):
    """sbatch --wait the example script, sized for this box; returns (result, job log text)."""
    log = tmp_path / "job.out"
    result = run(env, "sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2",
                 "--cpus-per-task=1", "--gpus-per-node=0", "--time=10", f"--output={log}",
                 SBATCH, *program, timeout=300, VENV="", LAUNCH=launch, **extra)
    output = log.read_text() if log.exists() else "<no job output>"
    assert result.returncode == 0, f"{explain(result)}\n--- job output\n{output}"
    return output


def test_the_example_batch_script_trains_with_srun(slurm, tmp_path, plain_reference):
    """sbatch examples/cluster/slurm_train.sbatch (its default launch line), a tiny model."""
    from test_training import QUIET, assert_ranks_identical, assert_same

    output = sbatch(slurm, tmp_path, "srun", TRAIN, json.dumps({}), str(tmp_path), **QUIET)
    weights = [[array for _, array in sorted(np.load(tmp_path / f"rank.{rank}.npz").items(),
                                             key=lambda item: int(item[0].split("_")[1]))]
               for rank in range(2)]
    assert_ranks_identical(weights)
    assert_same(weights[0], plain_reference)
    for start in ("trained 0 ", "trained 1 "):  # both tasks' stdout lands in the job log
        assert any(line.startswith(start) for line in output.splitlines()), output


def test_the_example_batch_script_with_mpirun_inside_the_allocation(slurm, tmp_path):
    """Its other launch line: mgpu-train -np $SLURM_NTASKS, Open MPI reading the allocation."""
    output = sbatch(slurm, tmp_path, "mpirun", REPORT, str(tmp_path), MGPU_ENGINE="none")
    for rank in range(2):
        report = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        assert (report["rank"], report["size"], report["local_rank"]) == (rank, 2, rank)
        assert report["env"]["MGPU_ENVIRONMENT"] == "openmpi"  # not the batch step's SLURM_*
        assert report["average"] == 1.5
    assert "[0] rank 0 done" in output.splitlines(), output  # rank 0's stdout, tagged


def test_srun_pmix_runs_the_keras_distribution_guide_and_the_ddp_tutorial(slurm, tmp_path):
    """Scripts written for Keras's distribution API (JAX) and for torchrun, unchanged, as
    ``srun --mpi=pmix mgpu-train`` tasks (docs/starting-processes.md): the tasks agree on the
    coordinator over MPI (PMIx) before each script runs."""
    from test_foreign_scripts import DDP, GUIDE, JAX, check_ddp, check_guide, ddp_job

    guide, ddp = tmp_path / "guide", tmp_path / "ddp"
    guide.mkdir()
    ddp.mkdir()
    result = run(slurm, "srun", "-n", "2", "--mpi=pmix", "mgpu-train", GUIDE, str(guide),
                 timeout=300, **JAX)
    assert result.returncode == 0, explain(result)
    reports = check_guide(guide, result)
    assert reports[0]["addresses"].count(",") == 1, reports[0]  # one address per task
    result = ddp_job(lambda: run(slurm, "srun", "-n", "2", "--mpi=pmix", "mgpu-train", DDP,
                                 str(ddp), "2", "1", timeout=300), ddp)
    assert result.returncode == 0, explain(result)
    check_ddp(ddp, result, epochs=2)
