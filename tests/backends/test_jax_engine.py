"""The JAX engine: when mgpu.init() may run, a coordinator nobody can reach, and the
2-process step against Keras's own in float64."""

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


def test_two_process_float64_step_is_keras_step_exactly():
    """Same rows on both ranks, float64: the distributed step must be Keras's step, to the
    bit. XLA's early CSE is off in both programs: with it, the 2-device program rounds the
    model's float32 islands differently from the 1-device one (~1e-5 relative here after 4
    Adam steps; benchmarks/jax_spmd_rounding.md), which is XLA's doing, not the step's."""
    result = launch_ok("-np", "2", os.path.join(SCRIPTS, "jax_float64_step.py"), timeout=300,
                       JAX_ENABLE_X64="1", XLA_FLAGS="--xla_disable_hlo_passes=cse", **JAX)
    # "[0] sgd dtype float64 ranks agree: True max_rel 0": rank 0's lines, prefixed
    lines = [s.split("] ", 1)[-1] for s in result.stdout.splitlines() if "max_rel" in s]
    assert [s.split()[0] for s in lines] == ["sgd", "adam"], explain(result)
    for line in lines:
        assert "dtype float64 ranks agree: True" in line, explain(result)
        assert float(line.split("max_rel")[1]) <= 1e-12, explain(result)
