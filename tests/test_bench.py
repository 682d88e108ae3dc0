"""mgpu-bench end to end on CPU processes (the tool's own pipeline, tiny model), and its errors."""

import importlib.util
import json
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import BACKEND, ROOT, assert_ok, explain, job_env, python_env, requires_mpirun

from mgpu_launch.bench.models import MODELS


def bench(*argv, timeout=600, job=True):
    """``python -m mgpu_launch.bench argv...``; job=False: it must stop at its argument check."""
    env = (job_env if job else python_env)(KERAS_BACKEND=BACKEND)
    return subprocess.run([sys.executable, "-m", "mgpu_launch.bench", *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


#: the tensorflow pass's one --gpus 1,2 run serves test_cpu_run_... and test_mirrored_row_...:
#: every job of test_cpu_run's own run (tensorflow at 1 and 2 processes) is in it, a TensorFlow
#: rank's start-up costs more than its 5 steps, and each test checks its own rows
WITH_MIRRORED = BACKEND == "tensorflow" and importlib.util.find_spec("tensorflow") is not None


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """``mgpu-bench --cpu --gpus 1,2`` of mlp-tiny on the backend under test with host and numpy
    data, under TensorFlow with the mirrored rows (host and device data) in the same run.

    Returns:
        (its CompletedProcess, its --out folder)
    """
    out = tmp_path_factory.mktemp("bench_cpu_run")
    backends, data = ("tensorflow,mirrored", "host,numpy,device") if WITH_MIRRORED else (
        BACKEND, "host,numpy")
    return assert_ok(bench("--cpu", "--gpus", "1,2", "--model", "mlp-tiny", "--steps", "5",
                           "--backend", backends, "--data", data, "--out", str(out))), out


@pytest.mark.job
@requires_mpirun
def test_cpu_run_writes_the_table_the_json_and_the_plot(cpu_run, backend):
    pytest.importorskip("matplotlib")
    result, out = cpu_run
    jobs = 3 if WITH_MIRRORED else 2  # (the mirrored job at 2 processes is skipped on CPU)
    assert f"[1/{jobs}] {backend}" in result.stdout and f"[2/{jobs}] " in result.stdout
    assert "gpus |   samples/s | speedup | efficiency | first step s" in result.stdout
    document = json.loads((out / "results.json").read_text())
    assert {"machine", "cpu_count", "versions", "date", "command", "method", "device"} <= set(
        document["header"])
    assert document["header"]["command"].startswith("mgpu-bench --cpu --gpus 1,2")
    rows = [r for r in document["rows"] if r["backend"] == backend and r["data"] != "device"]
    assert [(r["gpus"], r["data"]) for r in rows] == [(1, "host"), (1, "numpy"),
                                                      (2, "host"), (2, "numpy")]
    for row in rows:
        assert {"backend", "precision", "model", "batch_per_gpu", "gpus", "img_per_sec",
                "speedup", "efficiency"} <= set(row)
        assert row["backend"] == backend and row["model"] == "mlp-tiny"
        assert row["img_per_sec"] > 0 and len(row["per_rank_img_per_sec"]) == row["gpus"]
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["gpus"], abs=1e-3)
    assert [r["speedup"] for r in rows if r["gpus"] == 1] == [1.0, 1.0]
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| backend | model | precision |" in (out / "results.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "1,x"], "--gpus '1,x': expected comma-separated integers"),
    (["--model", "vgg16"], "unknown vgg16; expected one or more of: resnet50, inceptionv3"),
    (["--backend", "mxnet"], "unknown mxnet; expected one or more of: tensorflow, jax, torch"),
    (["--cpu", "--steps", "2", "--window", "5"], "need at least one timed window"),
    (["--cpu", "--backend", "torch+jit"],
     "unknown torch+jit; expected one or more of: tensorflow, jax, torch, torch+cudagraph, "
     "torch+compile, native, native+compile, mirrored"),
    (["--cpu", "--model", "mlp-tiny", "--data", "recipe"],
     "--data recipe: the keras-hub recipe (mgpu.data.shard of a tf.data of token ids) is for "
     "the transformer models"),
    (["--cpu", "--model", "gpt2-tiny-lm", "--data", "host-uint8"],
     "--data host-uint8: uint8 pixels are for image models, and gpt2-tiny-lm takes token ids"),
    (["--gpus", "1,2,64"], "asked for 64 GPUs, but this machine shows"),
    (["--cpu", "--cuda-graph", "0,on"], "unknown on; expected one or more of: 0, 1"),
    (["--cpu", "--data-format", "channels_last,nchw"],
     "--data-format 'channels_last,nchw': unknown nchw; expected one or more of: "
     "channels_last, channels_first"),
    (["--cpu", "--data-format", ","], "--data-format ',': expected at least one value"),
])
def test_bad_arguments_exit_2_and_say_why(argv, message):
    result = bench(*argv, timeout=60, job=False)
    assert result.returncode == 2, explain(result)
    assert message in result.stderr, explain(result)


@pytest.mark.job
@requires_mpirun
def test_a_job_past_its_timeout_is_killed_reported_and_the_rest_still_written(tmp_path):
    result = bench("--cpu", "--gpus", "1", "--model", "mlp-tiny", "--steps", "5",
                   "--backend", BACKEND, "--timeout", "1", "--out", str(tmp_path))
    assert result.returncode == 1, explain(result)
    assert "FAILED (exit 124)" in result.stdout and "1 of 1 jobs failed" in result.stderr
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == []
    assert "killed after 1 s" in (tmp_path / "logs" / f"{BACKEND}-mlp-tiny-float32-np1.log"
                                  ).read_text()


@pytest.mark.backend  # each backend's train function is wrapped by the step timer
@pytest.mark.job
@requires_mpirun
def test_profile_gives_every_rank_its_breakdown_and_uint8_pixels_feed(tmp_path, backend):
    result = assert_ok(bench("--cpu", "--gpus", "2", "--model", "mlp-tiny", "--steps", "5",
                             "--backend", backend, "--data", "host-uint8", "--profile",
                             "--out", str(tmp_path)))
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["data"] == "host-uint8" and row["img_per_sec"] > 0
    profile = row["per_rank_profile"]
    assert len(profile) == 2
    for rank in profile:
        assert rank["step_ms"] > 0 and rank["input_ms"] >= 0 and rank["wait_ms"] >= 0
        if backend == "jax":  # the allreduce can be left out of the step: comm is split off
            assert rank["compute_ms"] > 0 and "comm_ms" in rank
    assert min(rank["wait_ms"] for rank in profile) < 1.0  # someone is the last to arrive
    assert "Where the step time goes" in (tmp_path / "results.md").read_text()


@pytest.mark.job
@requires_mpirun
@pytest.mark.skipif(not WITH_MIRRORED,
                    reason="the mirrored row is Keras on TensorFlow (runs with the tensorflow "
                           "pass of the suite, and needs tensorflow installed)")
def test_mirrored_row_runs_one_process_beside_the_tensorflow_row(cpu_run):
    result, out = cpu_run  # --backend tensorflow,mirrored --data host,numpy,device
    # on CPU MirroredStrategy has one device: the 2-replica job is skipped, and says why
    assert "skipped mirrored mlp-tiny float32 on 2 processes: MirroredStrategy on CPU" in \
        result.stdout, explain(result)
    document = json.loads((out / "results.json").read_text())
    assert document["header"]["skipped"] == ["mirrored-mlp-tiny-float32-np2"]
    assert document["header"]["versions"]["mirrored"]["tensorflow"]
    rows = [r for r in document["rows"] if r["data"] != "numpy"]  # numpy: test_cpu_run's
    assert [(r["backend"], r["gpus"], r["data"]) for r in rows] == [
        ("tensorflow", 1, "host"), ("tensorflow", 1, "device"),
        ("tensorflow", 2, "host"), ("tensorflow", 2, "device"),
        ("mirrored", 1, "host"), ("mirrored", 1, "device")]
    assert [(r["backend"], r["gpus"]) for r in document["rows"] if r["data"] == "numpy"] == [
        ("tensorflow", 1), ("tensorflow", 2), ("mirrored", 1)]
    tensorflow, mirrored = rows[0], rows[4]
    for row in rows[4:]:
        assert row["img_per_sec"] > 0 and row["speedup"] == 1.0 and row["efficiency"] == 1.0
        assert row["replicas"] == 1 and row["processes"] == 1
        assert row["strategy"] == "MirroredStrategy" and row["devices"] == ["/cpu:0"]
    for key in ("model", "precision", "batch_per_gpu", "params", "data_format"):
        assert mirrored[key] == tensorflow[key], key
    assert "Keras + tf.distribute.MirroredStrategy mlp-tiny float32" in result.stdout
    assert "| mirrored | mlp-tiny | float32 |" in (out / "results.md").read_text()


@pytest.mark.job
@requires_mpirun
def test_each_data_format_is_its_own_row_set_in_the_worker(tmp_path, backend):
    result = assert_ok(bench("--cpu", "--gpus", "1", "--model", "mlp-tiny", "--steps", "5",
                             "--backend", backend, "--data", "host",
                             "--data-format", "channels_last,channels_first",
                             "--out", str(tmp_path)))
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    # data_format is what keras.config.image_data_format() said inside the worker
    assert [(r["data_format"], r["gpus"]) for r in rows] == [("channels_last", 1),
                                                             ("channels_first", 1)]
    assert all(r["img_per_sec"] > 0 and r["speedup"] == 1.0 for r in rows)
    for data_format in ("channels_last", "channels_first"):
        assert f"mlp-tiny float32 {data_format} (host" in result.stdout, explain(result)
    markdown = (tmp_path / "results.md").read_text()
    assert "| data format |" in markdown and "| channels_first |" in markdown
    assert (tmp_path / "logs" / f"{backend}-mlp-tiny-float32-channels_first-np1.json").exists()


def test_image_models_take_their_input_channels_first_when_asked():
    assert MODELS["resnet50"].shape("channels_first") == (3, 224, 224)
    assert MODELS["cifar-cnn"].shape("channels_first") == (3, 32, 32)
    assert MODELS["resnet50"].shape("channels_last") == (224, 224, 3)
    assert MODELS["mlp-tiny"].shape("channels_first") == (32,)  # no channels to move


@pytest.mark.job
@requires_mpirun
def test_recorder_rows_alternate_and_steps_per_execution_rows_time_whole_executions(tmp_path):
    # one 2-process job: rows off, on, off, on (the recorder dropped before each off row), each
    # at steps_per_execution 1 and 2; an on row keeps its efficiency report and its trace
    result = assert_ok(bench("--cpu", "--gpus", "2", "--model", "mlp-tiny", "--steps", "5",
                             "--window", "3", "--data", "host", "--recorder", "off,on,off,on",
                             "--steps-per-execution", "1,2", "--out", str(tmp_path)))
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    labels = ["recorder off #1", "recorder on #1", "recorder off #2", "recorder on #2"]
    assert [r["variant"] for r in rows] == labels + [
        f"{label}, steps_per_execution 2" for label in labels], explain(result)
    assert [r["recorder"] for r in rows] == [False, True] * 4
    assert all(r["img_per_sec"] > 0 for r in rows)
    assert all("efficiency of fit" in r["efficiency_report"] for r in rows if r["recorder"])
    assert all("efficiency_report" not in r for r in rows if not r["recorder"])
    trace = json.loads((tmp_path / "logs" / f"{BACKEND}-mlp-tiny-float32-np2.timeline-host.json")
                       .read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"} == {0, 1}
    assert "(host, prefetch 2, recorder on #2, steps_per_execution 2, batch" in result.stdout


@pytest.mark.job
@requires_mpirun
def test_sharded_optimizer_state_rows_show_the_bytes_each_rank_holds(tmp_path):
    # issue 60: one 2-process job, the optimizer compiled unsharded then sharded; every row has
    # each rank's optimizer-state bytes, and the efficiency report says them
    result = assert_ok(bench("--cpu", "--gpus", "2", "--model", "mlp-tiny", "--steps", "5",
                             "--window", "3", "--data", "host", "--recorder", "off,on",
                             "--shard-optimizer-state", "0,1", "--out", str(tmp_path)))
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["shard_optimizer_state"] for r in rows] == [False, False, True, True], \
        explain(result)
    assert rows[2]["variant"] == "recorder off, optimizer state sharded"
    whole, parts = rows[0]["optimizer_state_bytes"], rows[2]["optimizer_state_bytes"]
    assert len(whole) == len(parts) == 2 and whole[0] == whole[1] > 0
    assert max(parts) < whole[0] < sum(parts) < 2 * whole[0], (whole, parts)
    reports = [r["efficiency_report"] for r in rows if r["recorder"]]
    assert "optimizer state: " in reports[0] and "every rank holds all of it" in reports[0]
    assert "sharded: each rank updates its variables" in reports[1], reports[1]
    assert "optimizer state sharded" in result.stdout


def test_bad_steps_per_execution_and_recorder_values_exit_2():
    for argv, message in ((["--steps-per-execution", "0"], "expected integers >= 1"),
                          (["--recorder", "maybe"], "unknown maybe"),
                          (["--shard-optimizer-state", "2"], "unknown 2")):
        result = bench("--cpu", "--model", "mlp-tiny", *argv, job=False)
        assert result.returncode == 2 and message in result.stderr, explain(result)


def test_the_reference_rows_get_only_the_options_they_use():
    # native and mirrored have no mgpu prefetch, CUDA graph, steps_per_execution, recorder or
    # wire compression: their workers are not handed those knobs (they would ignore them)
    from mgpu_launch import bench as tool
    from mgpu_launch.bench import jobs
    args = tool.parse_args(["--cpu", "--model", "mlp-tiny", "--steps-per-execution", "1,4",
                            "--recorder", "off,on", "--compression", "bf16"])
    knobs = {"--prefetch", "--cuda-graph", "--steps-per-execution", "--recorder", "--compression",
             "--shard-optimizer-state"}
    for backend, expected in (("tensorflow", knobs), ("native", set()), ("mirrored", set())):
        command = jobs.command(args, backend, "mlp-tiny", "float32", "channels_last", 1,
                               "r.json")
        assert knobs & set(command) == expected, (backend, command)


@pytest.mark.job
@requires_mpirun
def test_resume_runs_only_the_jobs_a_cut_invocation_left_and_refuses_other_options(
        cpu_run, tmp_path):
    result, out = cpu_run
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    document = json.loads((out / "results.json").read_text())
    labels = [p.stem for p in sorted((cut / "logs").glob("*.json"))]
    missing = labels[0]  # as if the call had ended during that job (mirrored: the cheapest)
    (cut / "logs" / f"{missing}.json").unlink()
    argv = shlex.split(document["header"]["command"])[1:]
    argv[argv.index("--out") + 1] = str(cut)
    resumed = assert_ok(bench(*argv, "--resume"))
    assert f"resuming the invocation of {document['header']['date']}" in resumed.stdout
    assert resumed.stdout.count("reused from") == len(labels) - 1, explain(resumed)
    again = json.loads((cut / "results.json").read_text())
    assert sorted(again["header"]["reused"]) == sorted(set(labels) - {missing})
    assert (cut / "logs" / f"{missing}.json").exists()
    key = lambda r: (r["backend"], r["gpus"], r["data"])  # noqa: E731
    assert sorted(map(key, again["rows"])) == sorted(map(key, document["rows"]))
    # other options, or results that do not record theirs: refused before any job runs
    other = bench(*argv, "--steps", "10", "--resume")
    assert other.returncode == 2 and "steps: 5 there, 10 now" in other.stderr, explain(other)
    del again["header"]["options"]
    (cut / "results.json").write_text(json.dumps(again))
    older = bench(*argv, "--resume")
    assert older.returncode == 2 and "does not record its options" in older.stderr, explain(older)


def test_a_silent_job_is_killed_at_its_timeout(tmp_path):
    # A hung job prints nothing (a TF ResNet-50 job on 2 H200s, 2026-11-27, wrote no line for
    # 570 s past its --timeout 200): the timeout must not wait for a line to be read.
    import os
    import sys
    import time

    from mgpu_launch.bench import jobs
    tmp_path.chmod(0o700)
    started = time.monotonic()
    code = jobs.run([sys.executable, "-c", "print('started', flush=True); "
                     "import time; time.sleep(60)"], dict(os.environ),
                    str(tmp_path / "job.log"), 2)
    assert code == 124 and time.monotonic() - started < 20
    assert (tmp_path / "job.log").read_text().splitlines()[0] == "started"


#: the transformer runs are torch's: its eager step starts fastest on CPU (JAX and TensorFlow
#: compile the step for longer than these runs take); the other passes leave them out
def TORCH_PASS(test):
    """Run in the torch pass of the suite only: marked `backend`, which is what scripts/test.sh
    selects after its first (TensorFlow) pass; skipped in the others."""
    return pytest.mark.backend(pytest.mark.skipif(
        BACKEND != "torch", reason="runs in the torch pass of the suite")(test))


@pytest.fixture(scope="module")
def transformer_run(tmp_path_factory):
    """``mgpu-bench --cpu --gpus 1,2`` of gpt2-tiny-lm, Keras-torch (device and recipe data)
    beside native torch.

    Returns:
        (its CompletedProcess, its results.json as a dict)
    """
    out = tmp_path_factory.mktemp("bench_transformer_run")
    result = assert_ok(bench("--cpu", "--gpus", "1,2", "--model", "gpt2-tiny-lm", "--steps", "4",
                             "--window", "2", "--warmup-steps", "1", "--backend", "torch,native",
                             "--data", "device,recipe", "--out", str(out)))
    return result, json.loads((out / "results.json").read_text())


@TORCH_PASS
@pytest.mark.job
@requires_mpirun
def test_a_transformer_reports_tokens_per_second_and_its_first_step(transformer_run):
    pytest.importorskip("keras_hub")
    pytest.importorskip("tensorflow")  # the recipe mode's tf.data
    result, document = transformer_run
    rows = document["rows"]
    assert [(r["backend"], r["gpus"], r["data"]) for r in rows] == [
        ("torch", 1, "device"), ("torch", 1, "recipe"), ("torch", 2, "device"),
        ("torch", 2, "recipe"), ("native", 1, "device"), ("native", 2, "device")], \
        explain(result)
    for row in rows:
        assert row["model"] == "gpt2-tiny-lm" and row["unit"] == "tokens/s"
        assert row["tokens_per_sample"] == 32 and row["rate"] > 0
        assert row["rate"] == pytest.approx(32 * row["img_per_sec"], rel=1e-3)
        assert row["first_step_s"] > 0 and len(row["per_rank_img_per_sec"]) == row["gpus"]
        assert row["compiled"] is False  # --compile only; what ran (CPU: eager) is step_path
        assert (row["step_path"], row["step_fallback"]) == ("eager", None)
        # the eager Keras step and native eager: at speed after their first step
        assert (row["warmup_s"], row["ready_step"]) == (row["first_step_s"], 1)
    assert [r["speedup"] for r in rows if r["gpus"] == 1] == [1.0, 1.0, 1.0]
    assert "Keras torch gpt2-tiny-lm float32" in result.stdout
    assert "native torch gpt2-tiny-lm float32" in result.stdout
    assert ("gpus |    tokens/s | speedup | efficiency | first step s | warm-up s | step path"
            in result.stdout)
    assert " tokens/s (" in result.stdout and " sequences/s)" in result.stdout


@TORCH_PASS
@pytest.mark.job
@pytest.mark.slow  # torch.compile of a GPT-2 step takes ~70 s on a loaded 2-core box
@requires_mpirun
def test_native_rows_come_eager_and_compiled(tmp_path):
    result = assert_ok(bench("--cpu", "--gpus", "1", "--model", "gpt2-tiny-lm", "--steps", "4",
                             "--window", "2", "--warmup-steps", "1",
                             "--backend", "native,native+compile", "--out", str(tmp_path)))
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["backend"], r["compiled"]) for r in rows] == [("native", False),
                                                             ("native+compile", True)]
    assert all(r["rate"] > 0 and r["first_step_s"] > 0 for r in rows)
    assert [r["step_path"] for r in rows] == ["eager", "compiled"]
    # compiling the step is the first step's wait: longer than the eager first step; torch
    # compiles the whole step at its first call (no recompile: ready after it)
    assert rows[1]["first_step_s"] > rows[0]["first_step_s"], explain(result)
    assert [(r["warmup_s"], r["ready_step"]) for r in rows] == [
        (r["first_step_s"], 1) for r in rows], explain(result)
    markdown = (tmp_path / "results.md").read_text()
    assert "| native | gpt2-tiny-lm | float32 | device | - | 1 | eager |" in markdown
    assert "| rate | unit | samples/s |" in markdown and "| native+compile | gpt2-tiny-lm |" \
        in markdown
    assert "native torch.compile gpt2-tiny-lm" in result.stdout


def test_backend_names_pick_the_job_and_name_its_rows():
    from mgpu_launch import bench as tool
    from mgpu_launch.bench import jobs, names
    args = tool.parse_args(["--cpu", "--model", "gpt2-tiny-lm", "--cuda-graph", "0,1",
                            "--backend", "torch,torch+cudagraph,torch+compile,native,"
                                         "native+compile,jax"])
    assert args.backends == ["torch", "torch+cudagraph", "torch+compile", "native",
                             "native+compile", "jax"]

    def command(backend):
        return jobs.command(args, backend, "gpt2-tiny-lm", "float32", "channels_last", 1,
                            "r.json")

    def option(line, name):
        return line[line.index(name) + 1]
    assert option(command("torch"), "--cuda-graph") == "0,1"  # both rows from one job
    assert option(command("torch+cudagraph"), "--cuda-graph") == "1"
    assert option(command("torch+compile"), "--cuda-graph") == "0"
    assert "--compile" in command("torch+compile") and "--compile" not in command("torch")
    for backend, module in (("native", "mgpu_launch.bench.native"),
                            ("native+compile", "mgpu_launch.bench.native")):
        line = command(backend)
        assert module in line and ("--compile" in line) == (backend == "native+compile")
        assert "--prefetch" not in line
    environments = {b: jobs.environment(args, b, 1) for b in args.backends}
    assert [environments[b].get("KERAS_BACKEND") for b in ("torch+compile", "torch+cudagraph",
                                                           "jax")] == ["torch", "torch", "jax"]
    assert environments["native+compile"]["MGPU_ENGINE"] == "none"
    captured = {"cuda_graph": True, "cuda_graph_steps": {"replayed": 3}}
    fell_back = {"cuda_graph": True, "cuda_graph_steps": {"replayed": 0}}
    assert names.row_backend("torch", {"cuda_graph": False}) == "torch"
    assert names.row_backend("torch", captured) == "torch+cudagraph"
    assert names.row_backend("torch+cudagraph", captured) == "torch+cudagraph"
    assert names.row_backend("torch+cudagraph", fell_back) == "torch+cudagraph-fell-back"
    assert names.display("native+compile") == "native torch.compile"


def test_transformer_models_have_their_units_and_batches():
    import numpy as np
    gpt2, bert = MODELS["gpt2-small-lm"], MODELS["bert-base-classifier"]
    assert (gpt2.unit, gpt2.tokens_per_sample, gpt2.batch_per_gpu) == ("tokens/s", 256, 32)
    assert (bert.unit, bert.tokens_per_sample, bert.batch_per_gpu) == ("tokens/s", 128, 32)
    assert MODELS["resnet50"].unit == "img/s" and MODELS["mlp"].unit == "samples/s"
    x, y = gpt2.synthetic(np, gpt2.input_shape, 2, np.random.default_rng(0))
    assert x["token_ids"].shape == x["padding_mask"].shape == y.shape == (2, 256)
    assert x["token_ids"].max() < 8192 and x["padding_mask"].all()
    x, y = bert.synthetic(np, bert.input_shape, 2, np.random.default_rng(0))
    assert set(x) == {"token_ids", "segment_ids", "padding_mask"} and y.shape == (2,)
    assert y.max() < 2


@TORCH_PASS
@pytest.mark.job
@pytest.mark.slow  # the compiled Keras-torch step of a GPT-2: ~40-160 s on a loaded 2-core box
@requires_mpirun
def test_the_compiled_keras_torch_row_carries_its_compile_in_its_warmup(tmp_path):
    """mgpu's compiled torch step runs its first step eagerly and compiles at the second: its
    first step is as short as eager's, and the compile shows only in warmup_s (issue 63)."""
    pytest.importorskip("keras_hub")
    result = assert_ok(bench("--cpu", "--gpus", "1", "--model", "gpt2-tiny-lm", "--steps", "4",
                             "--window", "2", "--warmup-steps", "2", "--data", "device",
                             "--backend", "torch,torch+compile", "--out", str(tmp_path)))
    eager, compiled = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert (eager["step_path"], eager["ready_step"]) == ("eager", 1), explain(result)
    assert (compiled["step_path"], compiled["step_fallback"], compiled["compiled"]) == (
        "compiled", None, True), explain(result)
    assert compiled["ready_step"] == 2  # the eager first step, then traced + compiled + run
    # inductor's build of the graph (seconds) against an eager step of milliseconds
    assert compiled["warmup_s"] > 20 * compiled["first_step_s"], explain(result)
    assert compiled["warmup_s"] > 20 * eager["warmup_s"], explain(result)


def test_result_rows_with_and_without_the_waits_and_step_path_are_read():
    """Rows written before warmup_s / step_path (``compiled`` only) still read; the new fields
    are checked like every field results.md shows."""
    from mgpu_launch.bench import result_file
    old = {"model": "mlp-tiny", "data": "host", "data_format": "channels_last",
           "batch_per_gpu": 8, "img_per_sec": 10.0, "per_rank_img_per_sec": [10.0],
           "first_step_s": 0.5, "compiled": True}
    assert result_file.check({"rows": [old]}, "r")["rows"][0]["compiled"] is True
    new = dict(old, warmup_s=30.0, ready_step=2, step_path="compiled+cuda_graph",
               step_fallback=None)
    result_file.check({"rows": [new]}, "r")
    for field, value, why in (("step_path", "compiled | x", "step_path: expected one of eager"),
                              ("warmup_s", -1, "warmup_s: expected a finite number"),
                              ("ready_step", 0, "ready_step: expected an integer"),
                              ("step_fallback", ["a"], "step_fallback: expected null or a text")):
        with pytest.raises(result_file.BadResult, match=why):
            result_file.check({"rows": [dict(new, **{field: value})]}, "r")


def test_the_markdown_pairs_each_warmup_with_native_compile():
    from mgpu_launch.bench import report

    def row(backend, warmup, path):
        return {"backend": backend, "model": "gpt2-tiny-lm", "precision": "float32",
                "data_format": "channels_last", "data": "device", "prefetch": None,
                "variant": None, "batch_per_gpu": 8, "gpus": 1, "img_per_sec": 100.0,
                "per_rank_img_per_sec": [100.0], "speedup": 1.0, "efficiency": 1.0,
                "first_step_s": 0.1, "warmup_s": warmup, "step_path": path}
    text = report.markdown({}, [row("torch+compile", 30.0, "compiled"),
                                row("native+compile", 12.0, "compiled")])
    assert "| first step s | warm-up s | step path |" in text
    assert ("| torch+compile | gpt2-tiny-lm | float32 | device | - | 1 | compiled | 30 | 12 | "
            "2.5x |") in text
    assert "Warm-up against" not in report.markdown({}, [row("torch", 0.1, "eager")])
