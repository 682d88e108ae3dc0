"""``MGPU_BIND_ADDRESS`` (issue 58, item 5): the ranks dial the address rank 0's listeners are
bound to, so every rank reaches the stall inspector at a loopback address such as 127.0.0.2 on
one host; a loopback address for a job on several hosts is refused on every rank, naming it; an
address that is not one of rank 0's host's gets advice about the address, not about the port."""

import pytest

from conftest import explain, launch, requires_mpirun
from mgpu_launch.runtime import rendezvous

# Rank 0 waits (up to 60 s) until rank 1 has proved the job key to its inspector.
JOINED = """
import time, mgpu_launch as mgpu
from mgpu_launch.runtime import stall
mgpu.init()
if mgpu.rank() == 0:
    deadline = time.monotonic() + 60
    while 1 not in stall._inspector.server.joined and time.monotonic() < deadline:
        time.sleep(0.2)
    print("rank 1 joined" if 1 in stall._inspector.server.joined else "rank 1 never joined",
          stall._inspector.server.listener.getsockname()[0], flush=True)
mgpu.barrier()
"""


@requires_mpirun
@pytest.mark.job
def test_every_rank_reaches_the_inspector_at_another_loopback_address():
    result = launch("-np", "2", "-c", JOINED, MGPU_ENGINE="none", MGPU_BIND_ADDRESS="127.0.0.2",
                    timeout=240)
    assert result.returncode == 0, explain(result)
    assert "[0] rank 1 joined 127.0.0.2" in result.stdout, explain(result)


@requires_mpirun
@pytest.mark.job
def test_an_address_not_on_this_host_gets_advice_about_the_address():
    result = launch("-np", "2", "-c", "import mgpu_launch as m; m.init()", MGPU_ENGINE="none",
                    MGPU_BIND_ADDRESS="192.0.2.1", timeout=240)  # TEST-NET-1: on no host
    assert result.returncode != 0, explain(result)
    assert "MGPU_BIND_ADDRESS=192.0.2.1 is not an address of rank 0's host" in result.stderr, \
        explain(result)
    assert "Pick a port" not in result.stderr, explain(result)


def test_a_loopback_address_is_refused_for_a_job_on_several_hosts():
    problem = rendezvous.bind_problem("127.0.0.2", ["node1", "node2"])
    assert problem and "MGPU_BIND_ADDRESS=127.0.0.2 is a loopback address" in problem
    assert "2 hosts (node1, node2)" in problem
    assert rendezvous.bind_problem("127.0.0.2", ["node1"]) is None  # one host: every rank local
    assert rendezvous.bind_problem("10.0.0.1", ["node1", "node2"]) is None
    assert rendezvous.bind_problem("0.0.0.0", ["node1", "node2"]) is None
    assert rendezvous.bind_problem(None, ["node1", "node2"]) is None
    # the ranks dial what rank 0 binds (every interface: the job's host address)
    assert rendezvous.dial_host("127.0.0.1", "127.0.0.2") == "127.0.0.2"
    assert rendezvous.dial_host("10.0.0.1", "0.0.0.0") == "10.0.0.1"
    assert rendezvous.dial_host("10.0.0.1", None) == "10.0.0.1"
