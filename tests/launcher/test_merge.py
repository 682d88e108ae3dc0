"""Noise once: identical stderr lines of several ranks are shown once, tagged with the ranks.

The merger is tested in-process with a fake clock; a 4-rank run of examples/keras_digits.py
checks the real start-up lines of TensorFlow (the suite's first backend).
"""

import collections
import importlib.util
import io
import os
import re

import pytest

from conftest import explain, launch_ok, requires_mpirun
from mgpu_launcher import merge, mpirun, supervisor
from mgpu_launch.config import devices


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def merger(size=4, window=3.0):
    printed, clock = [], Clock()
    return merge.LineMerger(lambda tag, text: printed.append(f"{tag} {text}"), size=size,
                            window=window, clock=clock), printed, clock


def test_rank_tags_compress_runs():
    assert merge.ranks_tag([3, 0, 1, 2]) == "[0-3]"
    assert merge.ranks_tag([0, 2]) == "[0,2]"
    assert merge.ranks_tag([5, 0, 1, 2]) == "[0-2,5]"
    assert merge.ranks_tag([1]) == "[1]"


def test_a_line_every_rank_prints_goes_out_once_without_waiting():
    lines, printed, _ = merger()
    for rank in (2, 0, 3):
        lines.line(rank, "WARNING: All log messages before absl::InitializeLog()")
    assert printed == []
    lines.line(1, "WARNING: All log messages before absl::InitializeLog()")
    assert printed == ["[0-3] WARNING: All log messages before absl::InitializeLog()"]


def test_glog_time_and_thread_do_not_make_lines_different():
    lines, printed, _ = merger(size=2)
    lines.line(0, "I0000 00:00:1795418060.86 28350 port.cc:153] oneDNN custom operations")
    lines.line(1, "I0000 00:00:1795418061.01 28351 port.cc:153] oneDNN custom operations")
    assert printed == ["[0-1] I port.cc:153] oneDNN custom operations"]


def test_a_warning_of_one_rank_is_shown_with_its_rank_after_the_window():
    lines, printed, clock = merger()
    lines.line(2, "UserWarning: shard 2 is smaller")
    clock.now = 2.9
    lines.tick()
    assert printed == []
    clock.now = 3.0
    lines.tick()
    assert printed == ["[2] UserWarning: shard 2 is smaller"]


def test_lines_keep_the_order_they_were_first_seen_in():
    lines, printed, clock = merger(size=2)
    lines.line(0, "first")
    lines.line(0, "second")
    lines.line(1, "second")  # complete, but waits behind "first"
    assert printed == []
    clock.now = 5
    lines.tick()
    assert printed == ["[0] first", "[0-1] second"]


def test_tracebacks_and_errors_are_never_merged_nor_held():
    lines, printed, _ = merger(size=2)
    lines.line(0, "noise")  # held; must come out before rank 0's traceback
    for rank in (0, 1):
        lines.line(rank, "Traceback (most recent call last):")
        lines.line(rank, '  File "train.py", line 3, in <module>')
        lines.line(rank, "    main()")  # not error-like itself: passes as part of a traceback
        lines.line(rank, "ValueError: bad shard")
    assert printed == ["[0] noise", "[0] Traceback (most recent call last):",
                       '[0]   File "train.py", line 3, in <module>', "[0]     main()",
                       "[0] ValueError: bad shard", "[1] Traceback (most recent call last):",
                       '[1]   File "train.py", line 3, in <module>', "[1]     main()",
                       "[1] ValueError: bad shard"]
    lines.line(0, "E0000 00:00:1.0 1 op.cc:1] device lost")
    assert printed[-1] == "[0] E0000 00:00:1.0 1 op.cc:1] device lost"


# What one TF rank and one JAX rank print at start-up (2026-11-27, the 2-core box), glog
# prefixes as printed: TF loads absl twice, so the first two lines come twice a process.
TF_START_UP = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795783568.495932    5259 port.cc:153] oneDNN custom operations are on. You "
    "may see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
]
GRPC = "I0000 00:00:1795783728.628297   {pid} grpc_server_lib.cc:467] Started server with " \
       "target: grpc://localhost:{port}"
GLOO = "[Gloo] Rank {rank} is connected to 1 peer ranks. Expected number of connected peer " \
       "ranks is : 1"


def start_up(lines, rank):
    for text in TF_START_UP + TF_START_UP:  # twice in one process
        lines.line(rank, text)
    lines.line(rank, GRPC.format(pid=5259 + rank, port=39551 + rank))
    lines.line(rank, GLOO.format(rank=rank))
    lines.line(rank, "loading shard")


def test_start_up_chatter_is_dropped_or_shown_once_unless_asked_for():
    lines, printed, clock = merger(size=2)
    start_up(lines, 0)
    clock.now = 10  # rank 1 starts late: its copies come after rank 0's were printed
    lines.tick()
    start_up(lines, 1)
    lines.flush()
    assert printed == ["[0] " + TF_START_UP[1], "[0] loading shard", "[1] loading shard"]
    # MGPU_STARTUP_NOISE=1: every line back, merged as before (the oneDNN line once per copy)
    lines, printed, clock = merger(size=2)
    lines.quiet = False
    start_up(lines, 0)
    start_up(lines, 1)
    lines.flush()
    one_dnn = "[0-1] " + merge.normalize(TF_START_UP[1])
    assert printed.count(one_dnn) == 2 and printed.count("[0-1] " + TF_START_UP[0]) == 2
    assert "[0] " + GRPC.format(pid=5259, port=39551) in printed
    assert "[1] " + GLOO.format(rank=1) in printed, printed
    # an error never is chatter, even where it names a start-up line's words
    lines, printed, _ = merger(size=2)
    lines.line(0, "E0000 00:00:1.0 1 grpc_server_lib.cc:467] Started server failed: Error")
    assert printed == ["[0] E0000 00:00:1.0 1 grpc_server_lib.cc:467] Started server failed: "
                       "Error"]


def test_startup_noise_setting_reaches_the_relay(monkeypatch):
    def relayed():
        out, err = io.StringIO(), io.StringIO()
        relay = supervisor.OutputRelay(mpirun.OPENMPI, False, None, out, err, size=2)
        for rank in (0, 1):
            relay.line(f"[1,{rank}]<stderr>: {GRPC.format(pid=rank, port=rank)}", "stderr")
            relay.line(f"[1,{rank}]<stdout>: {GLOO.format(rank=rank)}", "stdout")  # JAX's
        relay.flush()
        return err.getvalue().splitlines() + out.getvalue().splitlines()
    assert relayed() == []
    monkeypatch.setenv("MGPU_STARTUP_NOISE", "1")
    assert relayed() == ["[0] " + GRPC.format(pid=0, port=0), "[1] " + GRPC.format(pid=1, port=1),
                         "[0] " + GLOO.format(rank=0)]  # stdout: rank 0's only


# TensorFlow's CUDA wheel on the 2-core box (no GPU), once per rank (2026-11-27).
CU_INIT = "E0000 00:00:1795794013.188595   {pid} cuda_platform.cc:52] failed call to cuInit: " \
          "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)"


def test_the_cuinit_error_line_is_dropped_only_where_the_launcher_saw_no_gpu():
    def shown(no_gpu, quiet=True):
        lines, printed, _ = merger(size=2)
        lines.quiet, lines.no_gpu = quiet, no_gpu
        for rank in (0, 1):
            lines.line(rank, CU_INIT.format(pid=21899 + rank))
            lines.line(rank, "loading shard")
        lines.flush()
        return printed
    assert shown(no_gpu=True) == ["[0-1] loading shard"]
    # a GPU host (or one the launcher cannot see): the line says why the GPU goes unused
    errors = ["[0] " + CU_INIT.format(pid=21899), "[1] " + CU_INIT.format(pid=21900)]
    assert shown(no_gpu=False) == [errors[0], errors[1], "[0-1] loading shard"]
    # MGPU_STARTUP_NOISE=1 shows it again, as the error line it is (never merged)
    assert shown(no_gpu=True, quiet=False) == [errors[0], errors[1], "[0-1] loading shard"]
    # after a traceback a rank's every line passes
    lines, printed, _ = merger(size=2)
    lines.no_gpu = True
    lines.line(1, "Traceback (most recent call last):")
    lines.line(1, CU_INIT.format(pid=1))
    assert printed == ["[1] Traceback (most recent call last):", "[1] " + CU_INIT.format(pid=1)]


def test_the_launcher_drops_the_cuinit_line_only_for_a_job_on_its_own_host_without_gpus(
        monkeypatch):
    local = ["mpirun", "-np", "2", "--tag-output", "python", "-m", "mgpu_launcher", "--", "t.py"]
    on_hosts = local[:3] + ["-H", "node1:2,node2:2"] + local[3:]
    monkeypatch.setattr(supervisor.devices, "visible_gpus", lambda environ=None: [])
    assert supervisor.no_gpu_anywhere(local, {})
    assert not supervisor.no_gpu_anywhere(on_hosts, {})  # node2 may have GPUs
    assert not supervisor.no_gpu_anywhere(local, {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"})
    assert not supervisor.no_gpu_anywhere(local, {"OMPI_MCA_orte_default_hostfile": "/h"})
    monkeypatch.setattr(supervisor.devices, "visible_gpus", lambda environ=None: ["0", "1"])
    assert not supervisor.no_gpu_anywhere(local, {})

    def relayed(no_gpu):
        out, err = io.StringIO(), io.StringIO()
        relay = supervisor.OutputRelay(mpirun.OPENMPI, False, None, out, err, size=2,
                                       no_gpu=no_gpu)
        for rank in (0, 1):
            relay.line(f"[1,{rank}]<stderr>: {CU_INIT.format(pid=rank)}", "stderr")
        relay.flush()
        return err.getvalue().splitlines(), relay.tails[0]
    assert relayed(no_gpu=True) == ([], collections.deque())  # nor among a failure's last lines
    printed, tail = relayed(no_gpu=False)
    assert printed == ["[0] " + CU_INIT.format(pid=0), "[1] " + CU_INIT.format(pid=1)]
    assert list(tail) == [CU_INIT.format(pid=0)]
    monkeypatch.setenv("MGPU_STARTUP_NOISE", "1")
    assert relayed(no_gpu=True)[0] == printed


def relay_lines(all_ranks):
    out, err = io.StringIO(), io.StringIO()
    relay = supervisor.OutputRelay(mpirun.OPENMPI, all_ranks, None, out, err, size=2)
    for rank in (0, 1):
        relay.line(f"[1,{rank}]<stderr>: same start-up line", "stderr")
    relay.flush()
    return err.getvalue().splitlines()


def test_all_ranks_output_shows_every_copy():
    assert relay_lines(all_ranks=False) == ["[0-1] same start-up line"]
    assert relay_lines(all_ranks=True) == ["[0] same start-up line", "[1] same start-up line"]


def test_a_failure_marker_behind_stray_bytes_is_still_the_root_cause():
    # CI, 1 raised fault in 20: "[1] \ufffdmgpu-train: rank failure: ..." gave "root cause: unknown".
    out, err = io.StringIO(), io.StringIO()
    # (a marker carries the job's key: only then is it found behind other bytes, issue 58)
    relay = supervisor.OutputRelay(mpirun.OPENMPI, False, None, out, err, size=2,
                                   marker_key="0f1e2d3c4b5a6978")
    relay.line("[1,1]<stderr>: \ufffd0f1e2d3c4b5a6978:mgpu-train: rank failure: RuntimeError: "
               "boom (exit code 1)", "stderr")
    relay.flush()
    assert relay.root_cause() == supervisor.Failure(1, "RuntimeError: boom (exit code 1)")
    assert "rank 1 failed first: RuntimeError: boom" in relay.summary(1)


def test_a_killed_ranks_last_lines_leave_out_start_up_notices():
    out, err = io.StringIO(), io.StringIO()
    relay = supervisor.OutputRelay(mpirun.OPENMPI, False, None, out, err, size=2)
    for text in ("WARNING: All log messages before absl::InitializeLog() is called are written "
                 "to STDERR",
                 "I0000 00:00:1795550327.021461   24552 port.cc:153] oneDNN custom operations "
                 "are on.",
                 "To enable the following instructions: AVX2 FMA, in other operations, rebuild "
                 "TensorFlow with the appropriate compiler flags.",
                 "loading shard 3", "W0000 00:00:1.0 1 op.cc:1] a warning stays"):
        relay.line(f"[1,1]<stderr>: {text}", "stderr")
    relay.line("Primary job  terminated normally, but 1 process returned", "stderr")
    relay.line("rank 1 with PID 4242 on node vm exited on signal 9 (Killed).", "stderr")
    relay.flush()
    summary = relay.summary(137)
    assert "rank 1 failed first: killed by signal 9 (SIGKILL)" in summary
    assert summary.endswith("last lines of rank 1's stderr:\n    loading shard 3\n"
                            "    W0000 00:00:1.0 1 op.cc:1] a warning stays"), summary


@requires_mpirun
@pytest.mark.job
def test_four_ranks_of_the_digits_example_print_tensorflows_start_up_lines_once(tmp_path):
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    # A wide window: four TF imports on two loaded CI cores can be seconds apart. The log level
    # is set: importing TensorFlow sets TF_CPP_MIN_LOG_LEVEL=1 in os.environ, which hides
    # these lines from every job started after any test imported TensorFlow in this process.
    result = launch_ok("-np", "4", "examples/keras_digits.py", "--epochs", "1", "--checkpoint",
                       str(tmp_path / "digits.keras"), timeout=400, KERAS_BACKEND="tensorflow",
                       MGPU_MERGE_SECONDS="15", TF_CPP_MIN_LOG_LEVEL="0")
    lines = result.stderr.splitlines()
    # TF prints absl's notice and the oneDNN one twice a process, and a gRPC server line per
    # rank: the notice is left once for the job, the rest is dropped (MGPU_STARTUP_NOISE=1
    # shows it: test_start_up_chatter_is_dropped_or_shown_once_unless_asked_for).
    one_dnn = [line for line in lines if "oneDNN custom operations are on" in line]
    assert len(one_dnn) == 1 and one_dnn[0].startswith("[0-3] "), explain(result)
    assert not [line for line in lines if "InitializeLog" in line or
                "Started server with target" in line], explain(result)
    texts = [re.sub(r"^\[[0-9,\-]+\] ", "", line) for line in lines]
    assert all(texts.count(text) == 1 for text in texts if "cpu_feature_guard" in text or
               "cudart_stub" in text), explain(result)
    if not devices.visible_gpus():  # TF's CUDA wheel (keras-hub brings it) tried the driver
        assert "failed call to cuInit" not in result.stderr, explain(result)
    assert "final validation accuracy" in result.stdout
