"""The control plane's interface and the one choice of it (mgpu_launch.runtime.transport).

The MPI transport's collectives run in every multi-process job test (examples, process sets,
timeline, stall); here: what the interface forces, and the refusal of a plane not supported.
"""

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


def test_a_plane_not_supported_is_refused_by_name_before_anything_starts(monkeypatch):
    for name in [n for env in environments.ENVIRONMENTS for n in env.variable_names()]:
        monkeypatch.delenv(name, raising=False)
    for name, value in TORCHRUN_RANK_1_OF_2.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError) as raised:
        mgpu.init()
    message = str(raised.value)
    for part in ("torchrun started this job (2 processes, coordinator node1:29500)",
                 "'torch' control plane", "Supported: mpi (mgpu-train -np N, mpirun"):
        assert part in message, message
    assert not mgpu.is_initialized() and runtime.state.transport is None


def test_one_process_joins_no_transport():
    mgpu.init()
    assert runtime.state.transport is None and mgpu.allgather_object("x") == ["x"]
