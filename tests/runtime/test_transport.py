"""The control plane's interface and the one choice of it (mgpu_launch.runtime.transport).

The MPI transport's collectives run in every multi-process job test (examples, process sets,
timeline, stall), torch.distributed's in tests/runtime/test_transport_torch.py; here: what the
interface forces, the refusal of a plane not supported, and a torchrun start that cannot
join.
"""

import socket

import pytest

import mgpu_launch as mgpu
from mgpu_launch import runtime
from mgpu_launch.config import environments
from mgpu_launch.runtime import transport

TORCHRUN_RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}


@pytest.fixture(autouse=True)
def fresh_runtime():
    mgpu.shutdown()
    yield
    mgpu.shutdown()


def test_a_transport_missing_a_method_fails_when_made():
    class Partial(transport.Transport):  # everything but close()
        name, rank, size = "partial", 0, 1
        thread_safe = broadcast_object = allgather_object = gather_object = barrier = None
        send_object = receive_object = allreduce_array = allgather_array = None
        broadcast_array = split = split_by_host = None

    with pytest.raises(TypeError, match="close"):
        Partial()


def test_every_supported_plane_implements_the_whole_interface():
    import importlib
    for plane, module_name in transport.TRANSPORTS.items():
        module = importlib.import_module(module_name)
        made = [cls for cls in vars(module).values() if isinstance(cls, type)
                and issubclass(cls, transport.Transport) and cls is not transport.Transport]
        assert made and all(not cls.__abstractmethods__ for cls in made), plane
        assert callable(module.join), plane
        assert plane in transport.supported()


def test_a_plane_not_supported_is_refused_by_name_before_anything_starts():
    placement = environments.Placement(rank=1, size=2, local_rank=1, local_size=2,
                                       source="pmix-only", control_plane="pmix",
                                       coordinator_address="node1:29500")
    with pytest.raises(RuntimeError) as raised:
        transport.join(placement)
    message = str(raised.value)
    for part in ("pmix-only started this job (2 processes, coordinator node1:29500)",
                 "'pmix' control plane", "Supported: mpi (mgpu-train -np N, mpirun",
                 "torch.distributed (torchrun"):
        assert part in message, message


def _torchrun_variables(monkeypatch, **variables):
    for name in [n for env in environments.ENVIRONMENTS for n in env.variable_names()]:
        monkeypatch.delenv(name, raising=False)
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_torchrun_variables_without_master_addr_are_refused_at_once(monkeypatch):
    _torchrun_variables(monkeypatch, **{k: v for k, v in TORCHRUN_RANK_1_OF_2.items()
                                        if k != "MASTER_ADDR"})
    with pytest.raises(RuntimeError) as raised:
        mgpu.init()
    message = str(raised.value)
    for part in ("torchrun started this job (RANK=1, WORLD_SIZE=2)",
                 "MASTER_ADDR / MASTER_PORT are not both set", "Start the job with torchrun"):
        assert part in message, message
    assert not mgpu.is_initialized() and runtime.state.transport is None


def test_a_store_nobody_serves_is_an_error_within_the_join_timeout(monkeypatch):
    import time
    with socket.socket() as free:  # a port of this host that no one listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    _torchrun_variables(monkeypatch, **dict(TORCHRUN_RANK_1_OF_2, MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=str(port)), MGPU_JOIN_TIMEOUT="3")
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        mgpu.init()
    assert time.monotonic() - started < 60
    message = str(raised.value)
    for part in (f"rank 1 could not reach torch's TCP store at 127.0.0.1:{port} within 3 s",
                 "raise MGPU_JOIN_TIMEOUT"):
        assert part in message, message
    assert not mgpu.is_initialized()


def test_one_process_joins_no_transport():
    mgpu.init()
    assert runtime.state.transport is None and mgpu.allgather_object("x") == ["x"]
