"""The recipe converges: 2 processes (scaled lr + warm-up) vs 1 process (base lr), real data."""

import os
import re
import subprocess
import sys

import pytest

from conftest import BACKEND, ROOT, assert_ok, job_env, launch, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.job,
              pytest.mark.usefixtures("backend")]
pytest.importorskip("sklearn")
ENV = {"KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "2"}
ACCURACY = re.compile(r"final validation accuracy: ([0-9.]+)")


def accuracy(result):
    return float(ACCURACY.search(assert_ok(result).stdout).group(1))


@pytest.mark.first_backend
def test_digits_two_processes_match_one_within_a_point(tmp_path):
    example = os.path.join(ROOT, "examples", "keras_digits.py")
    one = accuracy(subprocess.run(
        [sys.executable, example, "--checkpoint", str(tmp_path / "one.keras")], cwd=ROOT,
        env=job_env(**ENV), capture_output=True, text=True, timeout=300))
    two = accuracy(launch("-np", "2", example, "--checkpoint", str(tmp_path / "two.keras"),
                          timeout=300, **ENV))
    print(f"digits, 20 epochs, {BACKEND}: 1 process {one:.4f}, 2 processes {two:.4f}")
    assert abs(two - one) <= 0.01, (one, two)
    assert one > 0.95
