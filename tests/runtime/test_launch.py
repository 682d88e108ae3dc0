"""mgpu_launch.run (mgpu_launcher/python_api.py): a Python function on N processes through the
launcher, results back."""

import glob
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import timelinekit
from conftest import (SCRIPTS, gone_after_kill, job_env, processes_mentioning,
                      requires_mpirun, wait_for_ranks)

pytestmark = [requires_mpirun, pytest.mark.job]
sys.path.insert(0, SCRIPTS)
import run_fns  # noqa: E402

import mgpu_launch  # noqa: E402


@pytest.fixture(autouse=True)
def ranks_find_the_test_functions(monkeypatch):
    # The ranks unpickle run_fns.* by reference: they need it on their path (as a user's
    # module would be), and mpirun as root needs its permission variables. run_fns trains
    # nothing: MGPU_ENGINE=none keeps Keras and its framework (~4 s of CPU a rank) out of the
    # ranks; what is tested here is run()'s calling, results, errors and teardown.
    for name, value in job_env(PYTHONPATH=SCRIPTS + os.pathsep + job_env()["PYTHONPATH"],
                               MGPU_ENGINE="none").items():
        monkeypatch.setenv(name, value)


def test_a_timeline_is_one_track_per_rank_with_the_host_collectives(tmp_path):
    target = tmp_path / "run.json"
    assert mgpu_launch.run(run_fns.broadcast_rank_0s, np=2, timeline=str(target)) == {"rank": 0}
    tracks = timelinekit.check_trace(json.loads(target.read_text()))
    for rank in (0, 1):
        assert "host broadcast_object" in [e["name"] for e in tracks[(rank, 0)]], tracks


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
    leftover = subprocess.run(["pgrep", "-f", "mgpu_launcher.python_api"], capture_output=True,
                              text=True).stdout.split()
    assert not leftover, f"ranks left running: {leftover}"


def test_unpicklable_arguments_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match=r"args/kwargs cannot be pickled .*create that inside fn"
                                        r"|args/kwargs cannot be pickled .*cloudpickle"):
        mgpu_launch.run(run_fns.rank_and_size, args=(threading.Lock(),), np=2)
    with pytest.raises(ValueError, match=r"np=0; expected a whole number"):
        mgpu_launch.run(run_fns.rank_and_size, np=0)
    with pytest.raises(ValueError, match=r"--hosts entry 'node1:x' does not parse"):
        mgpu_launch.run(run_fns.rank_and_size, np=2, hosts="node1:x")  # read once, here


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


# -- from a thread other than the main one (a notebook's background thread, a web server's) ---
def test_runs_from_a_thread_and_leaves_the_callers_signal_handlers_alone():
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    outcome = {}

    def call():
        try:
            outcome["results"] = mgpu_launch.run(run_fns.rank_and_size, args=(5,), np=2,
                                                 all_ranks=True)
        except BaseException as error:  # noqa: B036 - the test reports whatever it was
            outcome["error"] = error

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(180)
    assert not thread.is_alive(), "mgpu_launch.run on a thread did not return in 180 s"
    assert "error" not in outcome, repr(outcome.get("error"))
    assert [(r["rank"], r["size"], r["value"]) for r in outcome["results"]] == [(0, 2, 5),
                                                                                (1, 2, 6)]
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers


# A driver whose (daemon) thread runs a function that never returns, the main thread waiting.
# Python keeps SIGINT ignored when its parent ignored it (a CI job started in the background
# of a non-interactive shell): the driver sets the default Ctrl-C behaviour of a program
# started from a terminal.
HANGING_DRIVER = textwrap.dedent("""
    import signal, sys, threading
    import mgpu_launch, run_fns

    signal.signal(signal.SIGINT, signal.default_int_handler)
    thread = threading.Thread(target=mgpu_launch.run, args=(run_fns.hang,), daemon=True,
                              kwargs={"args": (sys.argv[1],), "np": 2, "work_dir": sys.argv[2]})
    thread.start()
    thread.join()
""")


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_a_caller_interrupted_or_killed_while_its_thread_waits_leaves_no_rank(how, tmp_path):
    prefix, work_dir = str(tmp_path / "pid"), str(tmp_path / "work")
    driver = subprocess.Popen([sys.executable, "-c", HANGING_DRIVER, prefix, work_dir],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(glob.glob(prefix + ".*")) < 2:
            assert time.monotonic() < deadline and driver.poll() is None, driver.communicate()
            time.sleep(0.1)
        ranks = [open(path).read() for path in glob.glob(prefix + ".*")]
        job = processes_mentioning(work_dir)  # mpirun and the ranks (python -m ... WORK_DIR)
        assert len(job) >= 3, job
        assert all(any(line.startswith(pid + " ") for line in job) for pid in ranks), job
        driver.send_signal(how)  # Ctrl-C: KeyboardInterrupt in the main thread, then exit
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode != 0, err
    deadline = time.monotonic() + 30  # the reaper: SIGTERM, 5 s grace, SIGKILL
    while processes_mentioning(work_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(work_dir), (processes_mentioning(work_dir), err)
    assert "the job was stopped" in err, err


# The main thread's signal handlers cannot catch SIGKILL: the reaper covers that caller too.
MAIN_THREAD_DRIVER = textwrap.dedent("""
    import sys
    import mgpu_launch, run_fns

    mgpu_launch.run(run_fns.hang, args=(sys.argv[1],), np=2)
""")


def test_a_main_thread_caller_killed_leaves_no_rank_and_no_run_folder(tmp_path):
    prefix, temp, log = str(tmp_path / "pid"), tmp_path / "tmp", tmp_path / "stderr"
    temp.mkdir()  # the driver's TMPDIR: its mgpu-run-* folder lands in here
    with open(log, "w") as stderr:  # a file: the reaper may hold it open a few seconds more
        driver = subprocess.Popen([sys.executable, "-c", MAIN_THREAD_DRIVER, prefix],
                                  env={**os.environ, "TMPDIR": str(temp)},
                                  stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for_ranks(prefix, 2, driver, log)
        folders = glob.glob(str(temp / "mgpu-run-*"))
        assert len(folders) == 1, folders
        assert len(processes_mentioning(folders[0])) >= 3  # mpirun and the ranks
        gone = gone_after_kill(driver, folders[0])
    finally:
        if driver.poll() is None:
            gone_after_kill(driver, str(temp))
    assert gone is not None, f"the job outlived its SIGKILLed caller by 30 s\n{log.read_text()}"
    assert gone < 20, f"the job was gone only {gone:.1f} s after its caller's SIGKILL"
    deadline = time.monotonic() + 10  # the reaper removes it once the ranks are gone
    while os.path.exists(folders[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(folders[0]), "the run folder was left behind"
    print(f"job gone {gone:.1f} s after the caller's SIGKILL")
