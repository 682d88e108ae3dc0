"""Scripts written for other launchers run unchanged under mgpu-train (docs/starting-processes.md).

Real clients, on CPU, their output checked:

* keras-io's distribution guide, its JAX flow (tests/scripts/keras_distribution_guide.py):
  ``keras.distribution.initialize()`` from the KERAS_DISTRIBUTION_* variables mgpu-train exports,
  ``DataParallel``, ``fit``; under ``mgpu-train -np 2`` (the coordinator's port held by
  mgpu-train) and under ``mpirun ... mgpu-train`` (agreed over MPI by the ranks), and started by
  hand with the variables set as Keras's docs show (so the script is Keras's flow, not ours);
* pytorch/examples' ddp-tutorial-series ``multigpu_torchrun.py`` flow on gloo
  (tests/scripts/ddp_torchrun.py), under ``mgpu-train -np 2``, under ``mpirun ... mgpu-train``,
  and under torchrun itself (so the script is torchrun's flow, not ours);
* the bad cases: ``initialize(num_processes=3)`` in a 2-process job, and a torchrun-style start
  without MASTER_ADDR, each a clear error within a bounded time, never a hang;
* Keras master's torch ``DataParallel`` (not in Keras 3.15.1): only where MGPU_KERAS_MASTER
  names a checkout or build of it.

Each runs once (not per backend): the script picks its own backend.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, SCRIPTS, explain, find_mpirun, job_env, launch, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job]

GUIDE = os.path.join(SCRIPTS, "keras_distribution_guide.py")
DDP = os.path.join(SCRIPTS, "ddp_torchrun.py")
KERAS_TORCH = os.path.join(SCRIPTS, "keras_torch_data_parallel.py")
JAX = {"KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2"}


def mpirun_worker_mode(*argv, timeout, **extra):
    """``mpirun -np 2 python -m mgpu_launcher argv...``: worker mode, the ranks agree over MPI."""
    command = [find_mpirun(), "-np", "2", "--oversubscribe", sys.executable, "-m",
               "mgpu_launcher", *argv]
    return subprocess.run(command, cwd=ROOT, env=job_env(OMPI_MCA_btl="^tcp", **extra),
                          capture_output=True, text=True, timeout=timeout)


def check_guide(out, result, size=2):
    """The guide's reports of a job of `size` processes (also the cluster and Slurm tests')."""
    reports = [json.loads((out / f"rank.{rank}.json").read_text()) for rank in range(size)]
    for rank, report in enumerate(reports):
        assert (report["process_index"], report["process_count"]) == (rank, size), \
            explain(result)
        assert report["devices"] == size  # DataParallel's mesh spans every process
        assert report["loss"][-1] < 0.6 * report["loss"][0], report["loss"]
        assert report["loss"] == reports[0]["loss"]  # one global loss
    weights = [np.load(out / f"rank.{rank}.npz") for rank in range(size)]
    assert len(weights[0].files) == 4
    for other in weights[1:]:
        for name in weights[0].files:
            np.testing.assert_array_equal(weights[0][name], other[name])
    return reports


def test_keras_distribution_guide_under_mgpu_train(tmp_path):
    result = launch("-np", "2", GUIDE, str(tmp_path), timeout=600, **JAX)
    assert result.returncode == 0, explain(result)
    reports = check_guide(tmp_path, result)
    address = reports[0]["addresses"].split(",")
    assert len(address) == 2 and address[0].startswith("127.0.0.1:")


def test_keras_distribution_guide_under_mpirun(tmp_path):
    result = mpirun_worker_mode(GUIDE, str(tmp_path), timeout=600, **JAX)
    assert result.returncode == 0, explain(result)
    check_guide(tmp_path, result)


def test_keras_distribution_guide_started_by_hand_as_keras_documents(tmp_path):
    """Two plain processes with the KERAS_DISTRIBUTION_* variables set by hand: Keras's own way."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    addresses = f"127.0.0.1:{port},127.0.0.1:{port}"
    env = {key: value for key, value in job_env(**JAX).items()
           if not key.startswith(("OMPI_", "PMIX_", "MGPU_"))}
    ranks = [subprocess.Popen([sys.executable, GUIDE, str(tmp_path)], cwd=ROOT,
                              env={**env, "KERAS_DISTRIBUTION_JOB_ADDRESSES": addresses,
                                   "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                                   "KERAS_DISTRIBUTION_PROCESS_ID": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=600)[0])
    finally:
        for process in ranks:
            process.kill()
    assert [process.returncode for process in ranks] == [0, 0], "\n".join(outputs)
    check_guide(tmp_path, subprocess.CompletedProcess([], 0, "\n".join(outputs), ""))


def test_initialize_with_another_process_count_fails_at_once_on_every_rank(tmp_path):
    """The script asks for 3 processes in a job of 2: Keras compares the count with the
    addresses mgpu-train exported (one per process) and raises before any rank waits for the
    third; JAX alone would wait for it (its initialization timeout: 300 s by default)."""
    started = time.monotonic()
    result = launch("-np", "2", "--output-dir", str(tmp_path / "logs"), GUIDE,
                    str(tmp_path), "3", timeout=300, **JAX)
    assert result.returncode == 1, explain(result)
    assert time.monotonic() - started < 200, explain(result)  # no rank waited for a third
    assert "root cause: rank" in result.stderr, explain(result)
    assert "has 2 jobs, but num_processes is 3" in result.stderr, explain(result)
    assert "mgpu-train: hint: mgpu-train started this job with 2 processes" in result.stderr
    assert not list(tmp_path.glob("rank.*.json"))
    # Each rank failed on its own (none was left waiting): every rank's log that reached the
    # call has the error; a rank mpirun stopped after the first failure has no traceback.
    for rank in range(2):
        log = (tmp_path / "logs" / f"rank.{rank}.log").read_text()
        assert "Traceback" not in log or "num_processes is 3" in log, log


#: what torch 2.14's gloo prints when its transport thread (pt_gloo_runloop) aborts the process
#: while the process group is torn down: seen on this 2-core box under load, 1 job in 20-40,
#: after every rank had written its report (docs/starting-processes.md, "Known: gloo's teardown")
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def ddp_job(start, out, size=2):
    """Run `start()` (a DDP tutorial job writing into folder `out`), once more if its only fault
    was gloo's abort at teardown: every rank's report written (the training done, the
    process group being destroyed), then a rank killed by SIGABRT with GLOO_TEARDOWN_ABORT.
    A fault anywhere else, or twice, is returned as it is. The snapshot the job started from is
    put back for the second run, so a resume resumes from the same epoch."""
    snapshot = out / "snapshot.pt"
    before = snapshot.read_bytes() if snapshot.exists() else None
    result = start()
    output = result.stdout + result.stderr
    reports = [out / f"rank.{rank}.json" for rank in range(size)]
    if (result.returncode == 0 or GLOO_TEARDOWN_ABORT not in output or "SIGABRT" not in output
            or not all(report.exists() for report in reports)):
        return result
    print(f"gloo aborted a rank at teardown; the job runs once more:\n{explain(result)}")
    for report in reports:
        report.unlink()
    if before is None:
        snapshot.unlink(missing_ok=True)
    else:
        snapshot.write_bytes(before)
    return start()


def check_ddp(out, result, epochs=3, size=2, per_host=2):
    """The tutorial's reports of a job of `size` processes, `per_host` on each host in rank
    order (also the cluster and Slurm tests')."""
    reports = [json.loads((out / f"rank.{rank}.json").read_text()) for rank in range(size)]
    for rank, report in enumerate(reports):
        env = report["env"]
        assert (report["rank"], report["size"]) == (rank, size), explain(result)
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"],
                env["GROUP_RANK"]) == (str(rank), str(size), str(rank % per_host),
                                       str(per_host), str(rank // per_host)), env
        assert env["MASTER_ADDR"] and env["MASTER_PORT"]
        assert len(report["losses"]) == epochs - report["epochs_run"]
        assert report["losses"][-1] < 0.8 * report["losses"][0], report["losses"]
        assert report["weights"] == reports[0]["weights"]  # DDP kept them equal
    seen = [set(report["seen"]) for report in reports]
    assert sum(map(len, seen)) == len(set().union(*seen)) == 256  # DistributedSampler: disjoint
    return reports


def test_ddp_tutorial_under_mgpu_train_and_its_snapshot_resume(tmp_path):
    result = ddp_job(lambda: launch("-np", "2", DDP, str(tmp_path), "3", "1", timeout=600),
                     tmp_path)
    assert result.returncode == 0, explain(result)
    first = check_ddp(tmp_path, result)
    assert first[0]["epochs_run"] == 0 and (tmp_path / "snapshot.pt").exists()
    assert "[0] rank 0 losses" in result.stdout  # rank 0's print, tagged
    # The tutorial's resume: a new job loads the snapshot rank 0 saved after epoch 2.
    result = ddp_job(lambda: launch("-np", "2", DDP, str(tmp_path), "5", "1", timeout=600),
                     tmp_path)
    assert result.returncode == 0, explain(result)
    second = check_ddp(tmp_path, result, epochs=5)
    assert second[0]["epochs_run"] == second[1]["epochs_run"] == 3


def test_ddp_tutorial_under_mpirun(tmp_path):
    result = ddp_job(lambda: mpirun_worker_mode(DDP, str(tmp_path), "2", "1", timeout=600),
                     tmp_path)
    assert result.returncode == 0, explain(result)
    check_ddp(tmp_path, result, epochs=2)


def test_ddp_tutorial_under_torchrun_itself(tmp_path):
    """The same script under torchrun: it is torchrun's flow, not one made for mgpu-train."""
    command = torchrun_command()
    env = {key: value for key, value in job_env().items()
           if not key.startswith(("OMPI_", "PMIX_", "MGPU_"))}
    result = ddp_job(lambda: subprocess.run(
        [*command, "--standalone", "--nproc-per-node", "2", DDP, str(tmp_path), "2", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600), tmp_path)
    assert result.returncode == 0, explain(result)
    reports = check_ddp(tmp_path, result, epochs=2)
    assert reports[0]["env"]["MASTER_ADDR"]


def torchrun_command():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return ([torchrun] if os.access(torchrun, os.X_OK) else
            [sys.executable, "-m", "torch.distributed.run"])


def test_a_torchrun_style_start_without_master_addr_fails_at_once(tmp_path):
    """A rank of an srun step without PMIx: no MPI to agree over, so no MASTER_ADDR; rank 0
    says why, and torch's env:// set-up fails at once instead of waiting for a store."""
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
             "SLURM_TASKS_PER_NODE": "1(x2)"}
    env = {key: value for key, value in job_env(**slurm).items()
           if not key.startswith(("OMPI_", "PMIX_", "MGPU_", "MASTER_"))}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mgpu_launcher", DDP, str(tmp_path), "1",
                             "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and time.monotonic() - started < 100, explain(result)
    assert "srun --mpi=pmix" in result.stderr, explain(result)  # our warning, rank 0
    assert "MASTER_ADDR" in result.stderr.split("srun --mpi=pmix", 1)[1], explain(result)


@pytest.mark.skipif(not os.environ.get("MGPU_KERAS_MASTER"),
                    reason="MGPU_KERAS_MASTER is not set: give it the path of a Keras master "
                           "checkout (its torch DataParallel is not in Keras 3.15.1), e.g. a "
                           "`pip install --no-deps --target DIR` of keras-team/keras")
def test_keras_master_torch_data_parallel_under_mgpu_train(tmp_path):
    master = os.environ["MGPU_KERAS_MASTER"]
    result = launch("-np", "2", KERAS_TORCH, str(tmp_path), timeout=600,
                    KERAS_BACKEND="torch",
                    PYTHONPATH=os.pathsep.join([ROOT, master, os.environ.get("PYTHONPATH", "")]))
    assert result.returncode == 0, explain(result)
    reports = [json.loads((tmp_path / f"rank.{rank}.json").read_text()) for rank in range(2)]
    assert [report["world_size"] for report in reports] == [2, 2], explain(result)
    assert reports[0]["keras_file"].startswith(master)  # master's Keras, not the installed one
    assert reports[0]["weights"] == reports[1]["weights"]
    assert reports[0]["loss"][-1] < reports[0]["loss"][0]
