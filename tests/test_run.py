"""mgpu_launch.run: a Python function on N processes through the launcher, results back."""

import os
import pickle
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import SCRIPTS, explain, job_env, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.job]
sys.path.insert(0, SCRIPTS)
import run_fns  # noqa: E402

import mgpu_launch  # noqa: E402


@pytest.fixture(autouse=True)
def ranks_find_the_test_functions(monkeypatch):
    # The ranks unpickle run_fns.* by reference: they need it on their path (as a user's
    # module would be), and mpirun as root needs its permission variables.
    for name, value in job_env(PYTHONPATH=SCRIPTS + os.pathsep +
                               job_env()["PYTHONPATH"]).items():
        monkeypatch.setenv(name, value)


def test_returns_rank_zeros_result_or_every_ranks():
    first = mgpu_launch.run(run_fns.rank_and_size, args=(10,), kwargs={"scale": 2}, np=2)
    assert (first["rank"], first["size"], first["value"]) == (0, 2, 20)
    assert first["pid"] != os.getpid()
    every = mgpu_launch.run(run_fns.rank_and_size, args=(10,), np=2, all_ranks=True)
    assert [(r["rank"], r["size"], r["value"]) for r in every] == [(0, 2, 10), (1, 2, 11)]


def test_a_raising_function_raises_in_the_caller_with_the_remote_traceback(capfd):
    with pytest.raises(mgpu_launch.RemoteError) as caught:
        mgpu_launch.run(run_fns.fail_on_rank_one, np=2)
    error = caught.value
    assert error.rank == 1 and error.remote_type == "KeyError" and error.exit_status != 0
    assert "rank 1 failed with KeyError: 'no such shard on rank 1'" in str(error)
    assert 'run_fns.py", line' in error.remote_traceback
    assert "raise KeyError" in error.remote_traceback
    leftover = subprocess.run(["pgrep", "-f", "mgpu_launch.launch"], capture_output=True,
                              text=True).stdout.split()
    assert not leftover, f"ranks left running: {leftover}"


def test_unpicklable_arguments_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match=r"args/kwargs cannot be pickled .*create that inside fn"
                                        r"|args/kwargs cannot be pickled .*cloudpickle"):
        mgpu_launch.run(run_fns.rank_and_size, args=(threading.Lock(),), np=2)
    with pytest.raises(ValueError, match=r"np=0; expected a whole number"):
        mgpu_launch.run(run_fns.rank_and_size, np=0)


def test_works_from_a_python_c_driver_with_a_function_defined_there(tmp_path):
    pytest.importorskip("cloudpickle")
    driver = textwrap.dedent("""
        import pickle, sys
        import mgpu_launch

        def where(base):
            import mgpu_launch as mgpu
            mgpu.init()
            return base + mgpu.rank(), mgpu.size()

        results = mgpu_launch.run(where, args=(100,), np=2, all_ranks=True)
        sys.stdout.buffer.write(b"RESULT" + pickle.dumps(results))
    """)
    result = subprocess.run([sys.executable, "-c", driver], env=job_env(), capture_output=True,
                            timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr.decode()
    assert pickle.loads(result.stdout.split(b"RESULT", 1)[1]) == [(100, 2), (101, 2)]


def test_horovods_run_signature_returns_every_rank():
    import mgpu_launch.keras as horovod
    results = horovod.run(run_fns.rank_and_size, args=(0,), np=2, hosts="localhost:2",
                          use_gloo=False, use_mpi=True, verbose=2)
    assert [r["rank"] for r in results] == [0, 1]
    with pytest.raises(ValueError, match="min_np=2 is not supported"):
        horovod.run(run_fns.rank_and_size, np=2, min_np=2)
