"""The quick-start example and the benchmark script run end to end (small sizes, CPU)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, explain, job_env, launch, requires_mpirun

BACKEND = os.environ.get("KERAS_BACKEND", "tensorflow")
pytestmark = [requires_mpirun, pytest.mark.backend]
pytest.importorskip(BACKEND)
ENV = {"KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_quick_start_example_trains_on_two_processes(tmp_path):
    checkpoint = tmp_path / "train.keras"
    result = launch("-np", "2", "examples/train.py", "--epochs", "1", "--checkpoint",
                    str(checkpoint), timeout=300, **ENV)
    assert result.returncode == 0, explain(result)
    assert "validation accuracy after 1 epochs on 2 processes" in result.stdout, explain(result)
    assert "samples_per_sec" in result.stdout and checkpoint.exists()


def test_benchmark_script_writes_its_table_and_json(tmp_path):
    command = [sys.executable, "benchmarks/keras_resnet50.py", "--backend", BACKEND,
               "--model", "small-cnn", "--image-size", "16", "--batch-per-gpu", "4",
               "--steps", "4", "--warmup-steps", "2", "--window", "2",
               "--precision", "float32", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, env=job_env(**ENV), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, explain(result)
    document = json.loads((tmp_path / "results.json").read_text())
    assert {"machine", "device", "versions", "date", "command"} <= set(document["header"])
    rows = document["rows"]
    assert [(r["gpus"], r["data"]) for r in rows] == [(1, "device"), (1, "host"),
                                                      (2, "device"), (2, "host")]
    for row in rows:
        assert row["backend"] == BACKEND and row["batch_per_gpu"] == 4
        assert row["img_per_sec"] > 0 and len(row["per_rank_img_per_sec"]) == row["gpus"]
        assert 0 < row["efficiency"]
    assert "| backend | precision | data | gpus | img/s |" in result.stdout


def test_benchmark_script_rejects_bad_arguments(tmp_path):
    result = subprocess.run([sys.executable, "benchmarks/keras_resnet50.py", "--gpus", "1,x"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--gpus '1,x': expected comma-separated integers" in result.stderr
