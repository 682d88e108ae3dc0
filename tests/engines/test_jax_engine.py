"""The JAX engine's set-up: when mgpu.init() may run, and a coordinator nobody can reach."""

import os
import time

import pytest

from conftest import BACKEND, SCRIPTS, explain, launch, launch_ok, requires_mpirun

pytestmark = [requires_mpirun, pytest.mark.backend, pytest.mark.job,
              pytest.mark.skipif(BACKEND != "jax", reason="JAX-backend only"),
              pytest.mark.usefixtures("backend")]

SCRIPT = os.path.join(SCRIPTS, "jax_init.py")
JAX = {"KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_importing_keras_and_jax_before_init_is_fine():
    result = launch_ok("-np", "2", SCRIPT, "imports-first", timeout=120, **JAX)
    # Same weights on both ranks after a step; 2 devices in the job, 1 in this process.
    assert "ranks agree: True devices 2 local 1" in result.stdout, explain(result)


def test_init_after_jax_used_a_device_is_refused_clearly():
    result = launch("-np", "2", SCRIPT, "device-first", timeout=120, **JAX)
    assert result.returncode != 0
    assert "mgpu.init() must run before JAX uses any device" in result.stderr, explain(result)


def test_unreachable_coordinator_fails_fast_and_clearly():
    started = time.monotonic()
    result = launch("-np", "2", SCRIPT, "imports-first", timeout=120,
                    MGPU_JAX_COORDINATOR="192.0.2.1:12345", MGPU_JAX_INIT_TIMEOUT="3", **JAX)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "the rendezvous address 192.0.2.1:12345 does not work" in result.stderr, \
        explain(result)
    assert elapsed < 60, f"took {elapsed:.0f} s"
