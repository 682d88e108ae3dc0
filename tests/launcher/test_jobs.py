"""Real multi-process runs of the launcher (mgpu-train) on CPU: placement, collectives, output,
failures."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import (ROOT, SCRIPTS, assert_ok, explain, find_mpirun, gone_after_kill, job_env,
                      launch, launch_ok, processes_mentioning, requires_mpirun, wait_for_ranks)

REPORT = os.path.join(SCRIPTS, "report.py")
FAIL = os.path.join(SCRIPTS, "fail.py")

pytestmark = [requires_mpirun, pytest.mark.job]

# These ranks test the launcher (placement, host collectives, output, exit codes, teardown), not
# training: MGPU_ENGINE=none keeps Keras and its framework out of them (a TensorFlow rank costs
# ~4 s of CPU to start on a 2-core box). The engine's own start-up runs in every training test;
# the one failing-rank case that needs TensorFlow's start-up lines keeps it.
NO_ENGINE = {"MGPU_ENGINE": "none"}


def read_reports(directory, size):
    reports = []
    for rank in range(size):
        with open(os.path.join(directory, f"rank.{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


def check_two_rank_reports(reports):
    for rank, report in enumerate(reports):
        assert (report["rank"], report["size"], report["local_rank"], report["local_size"]) == (rank, 2, rank, 2)
        assert (report["cross_rank"], report["cross_size"], report["chief"]) == (0, 1, rank == 0)
        assert report["env"]["MGPU_RANK"] == str(rank) and report["env"]["MGPU_SIZE"] == "2"
        assert report["name"] == "__main__"
        assert report["average"] == 1.5
        assert report["sum"] == [0, 3, 6]
        assert report["max"] == 1
        assert report["gather"] == [[0, 0], [1, 1], [1, 1]]
        assert report["broadcast"] == [10, 10, 10, 10]
        assert report["object"] == {"from": 0, "tag": ""}
        assert "ranks disagree" in report["mismatch"] and "shape=(2,)" in report["mismatch"]


def test_standalone_two_ranks(tmp_path):
    result = launch_ok("-np", "2", REPORT, str(tmp_path), **NO_ENGINE)
    check_two_rank_reports(read_reports(tmp_path, 2))
    assert reports_argv_ok(read_reports(tmp_path, 2), [str(tmp_path)])
    # Only rank 0's stdout by default, tagged with its rank.
    assert "[0] rank 0 done" in result.stdout and "rank 1 done" not in result.stdout


def reports_argv_ok(reports, argv):
    return all(report["argv"] == argv for report in reports)


def test_all_ranks_output_and_per_rank_logs(tmp_path):
    logs = tmp_path / "logs"
    result = launch_ok("-np", "2", "--all-ranks-output", "--output-dir", str(logs), REPORT,
                       str(tmp_path), **NO_ENGINE)
    assert "[0] rank 0 done" in result.stdout and "[1] rank 1 done" in result.stdout
    for rank in range(2):
        assert f"rank {rank} done" in (logs / f"rank.{rank}.log").read_text()


def test_under_plain_mpirun(tmp_path):
    command = [find_mpirun(), "-np", "2", "--oversubscribe", sys.executable, "-m", "mgpu_launcher",
               REPORT, str(tmp_path)]
    assert_ok(subprocess.run(command, cwd=ROOT, env=job_env(**NO_ENGINE), capture_output=True,
                             text=True, timeout=120))
    check_two_rank_reports(read_reports(tmp_path, 2))


def test_module_and_code_modes():
    code = "import sys, mgpu_launch as m; m.init(); print('code', m.rank(), m.size(), sys.argv)"
    result = launch_ok("-np", "2", "--all-ranks-output", "-c", code, "a1", **NO_ENGINE)
    assert "[1] code 1 2 ['-c', 'a1']" in result.stdout
    result = launch_ok("-np", "2", "-m", "json.tool", "--help")
    assert "[0] usage:" in result.stdout


def test_single_process_without_mpirun(tmp_path):
    launch_ok(REPORT, str(tmp_path))
    report = read_reports(tmp_path, 1)[0]
    assert (report["size"], report["average"], report["gather"]) == (1, 1.0, [[0, 0]])
    assert report["env"]["MGPU_ENVIRONMENT"] == "single"


def test_exit_status_is_pythons():
    assert launch("-c", "import sys; sys.exit(3)").returncode == 3
    result = launch("-c", "raise ValueError('nope')")
    assert result.returncode == 1
    assert result.stderr.startswith("Traceback") and "ValueError: nope" in result.stderr
    assert "launcher" not in result.stderr  # no launcher frames in the user's traceback


@pytest.mark.parametrize("how, cause", [
    ("raise", "rank 1 failed first: RuntimeError: boom on purpose from rank 1 (exit code 1)"),
    ("exit", "rank 1 failed first: exit code 7"),
    ("signal", "rank 1 failed first: killed by signal 9 (SIGKILL)"),
])
def test_a_failing_rank_stops_the_job_fast(how, cause, tmp_path):
    failed_at = tmp_path / "failed_at"  # fail.py writes time.time() just before failing
    # A SIGKILLed rank's summary shows its last stderr lines: that case keeps TensorFlow (the
    # engine's default), whose start-up lines must not be among them.
    result = launch("-np", "2", FAIL, how, "1", str(failed_at), timeout=120,
                    **({} if how == "signal" else NO_ENGINE))
    ended = time.time()
    assert result.returncode != 0, explain(result)
    assert cause in result.stderr, explain(result)
    summary = result.stderr[result.stderr.index("mgpu-train: the job failed"):]
    if how == "raise":
        assert "Traceback" in summary and "fail.py" in summary
    # Start-up notices (TF's oneDNN and CPU lines, absl's) are no clue to a failure.
    assert "oneDNN" not in summary and "InitializeLog" not in summary, summary
    # Rank 0 is blocked in a barrier; the job must not wait for it. Timed from the failure,
    # not from the start: start-up (TF's import) on a loaded box is no part of it.
    elapsed = ended - float(failed_at.read_text())
    assert elapsed < 15, f"ended {elapsed:.1f} s after the failure\n{explain(result)}"


def test_too_few_slots_is_a_root_cause_with_its_fix():
    result = launch("-np", "4", "-H", "localhost:1", "-c", "print('never')", timeout=60)
    assert result.returncode != 0, explain(result)
    summary = result.stderr[result.stderr.index("mgpu-train: the job failed"):]
    assert ("root cause: mpirun did not start the job: the hosts offer fewer slots than the 4 "
            "processes asked for") in summary, summary
    assert "--oversubscribe" in summary and "unknown" not in summary


def test_sigterm_to_the_launcher_leaves_nothing_behind(tmp_path):
    pidfile = str(tmp_path / "pid")
    proc = subprocess.Popen([sys.executable, "-m", "mgpu_launcher", "-np", "2", FAIL, "hang", "99", pidfile],
                            cwd=ROOT, env=job_env(**NO_ENGINE), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(glob.glob(pidfile + ".*")) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    pids = [int(open(path).read()) for path in glob.glob(pidfile + ".*")]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "got SIGTERM, stopping every rank" in err
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    assert not alive, f"ranks still running: {alive}"


def test_sigkill_to_the_launcher_leaves_no_process(tmp_path):
    # No handler runs on SIGKILL: the attempt's reaper, a process of its own, ends the job.
    pidfile, log = str(tmp_path / "pid"), tmp_path / "stderr"
    with open(log, "w") as stderr:  # a file: the reaper may hold it open a few seconds more
        proc = subprocess.Popen([sys.executable, "-m", "mgpu_launcher", "-np", "2", FAIL, "hang",
                                 "99", pidfile], cwd=ROOT, env=job_env(**NO_ENGINE),
                                stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        wait_for_ranks(pidfile, 2, proc, log)
        assert len(processes_mentioning(pidfile)) >= 3  # mgpu-train, mpirun, the ranks
        gone = gone_after_kill(proc, pidfile)
    finally:
        if proc.poll() is None:
            gone_after_kill(proc, pidfile)
    assert gone is not None, f"the job outlived mgpu-train's SIGKILL by 30 s\n{log.read_text()}"
    assert gone < 20, f"the job was gone only {gone:.1f} s after mgpu-train's SIGKILL"
    print(f"job gone {gone:.1f} s after mgpu-train's SIGKILL")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
