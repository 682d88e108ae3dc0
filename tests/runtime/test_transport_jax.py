"""mgpu scripts started as plain processes with JAX's variables (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID), no mgpu-train, MPI or torchrun: the jax.distributed
control plane (mgpu_launch.runtime.transport_jax).

Every test bounds its processes in time (conftest.jax_processes kills them at its timeout).
The exactness cases are in tests/test_training.py
(test_started_without_mpi_two_processes_equal_one_process, with KERAS_BACKEND=jax).
"""

import json
import os
import time

import pytest

from conftest import SCRIPTS, explain, jax_processes, processes_mentioning
from runtime.test_process_sets import check_static_sets

pytestmark = pytest.mark.job


def test_host_collectives_process_sets_and_the_timeline_over_jax_distributed(tmp_path):
    # 4 processes: the static process sets (key prefixes of their own in the coordination
    # service), every host collective within them and their refusals, exactly as over MPI;
    # the timeline's clock offsets through the store's point-to-point keys.
    trace = tmp_path / "trace.json"
    result = jax_processes(4, os.path.join(SCRIPTS, "process_sets.py"), str(tmp_path),
                           timeout=300, MGPU_ENGINE="none", MGPU_TIMELINE=str(trace))
    assert result.returncode == 0, explain(result)
    check_static_sets([json.loads((tmp_path / f"rank.{r}.json").read_text())
                       for r in range(4)])
    events = json.loads(trace.read_text())["traceEvents"]
    assert {event["pid"] for event in events} == {0, 1, 2, 3}


def test_a_failing_process_ends_the_others_within_jax_s_heartbeat_timeout(tmp_path):
    # Process 1 raises while process 0 waits in the next collective: no launcher is there to
    # end process 0; JAX's coordination service does, when process 1's heartbeats stop
    # (100 s, jax.distributed.initialize's default), measured 104 s for the whole job here.
    marker = str(tmp_path / "fail-marker")
    started = time.monotonic()
    result = jax_processes(2, os.path.join(SCRIPTS, "fail.py"), "raise", "1", marker,
                           timeout=280, MGPU_ENGINE="none")
    assert result.returncode != 0, explain(result)
    assert "boom on purpose from rank 1" in result.stderr, explain(result)
    assert time.monotonic() - started < 280
    assert not processes_mentioning(marker)


def test_jax_variables_without_a_coordinator_are_refused_at_once(tmp_path):
    result = jax_processes(1, os.path.join(SCRIPTS, "fail.py"), "exit", "9", str(tmp_path),
                           timeout=120, MGPU_ENGINE="none", JAX_NUM_PROCESSES="2",
                           JAX_COORDINATOR_ADDRESS="")
    assert result.returncode != 0, explain(result)
    assert ("jax-variables started this job (process 0 of 2) but JAX_COORDINATOR_ADDRESS is "
            "not host:port" in result.stderr), explain(result)
