"""The runtime on one process (no launcher): identity collectives, errors, init/shutdown."""

import numpy as np
import pytest

import mgpu_launch as mgpu


@pytest.fixture(autouse=True)
def fresh_runtime():
    mgpu.shutdown()
    yield
    mgpu.shutdown()


def test_collectives_before_init_raise_clearly():
    assert not mgpu.is_initialized()
    for call in (mgpu.size, mgpu.rank, lambda: mgpu.allreduce(1.0), mgpu.barrier,
                 lambda: mgpu.broadcast_object(1)):
        with pytest.raises(mgpu.NotInitializedError, match=r"call mgpu.init\(\)"):
            call()


def test_single_process_topology_and_idempotent_init():
    mgpu.init()
    mgpu.init()
    assert (mgpu.size(), mgpu.rank(), mgpu.local_rank(), mgpu.local_size()) == (1, 0, 0, 1)
    assert (mgpu.cross_rank(), mgpu.cross_size(), mgpu.is_chief()) == (0, 1, True)


def test_single_process_collectives_keep_the_callers_types():
    mgpu.init()
    assert mgpu.allreduce(3) == 3.0 and isinstance(mgpu.allreduce(3), float)
    assert mgpu.allreduce(3, op=mgpu.Sum) == 3 and isinstance(mgpu.allreduce(3, op=mgpu.Sum), int)
    value = np.arange(4, dtype=np.float32)
    out = mgpu.allreduce(value)
    assert out is not value and np.array_equal(out, value) and out.dtype == np.float32
    assert mgpu.allgather(5).tolist() == [5]
    assert mgpu.broadcast(np.float64(2.5)) == 2.5
    assert mgpu.broadcast_object({"a": 1}) == {"a": 1}
    assert mgpu.allgather_object("x") == ["x"]
    mgpu.barrier()


def test_bad_arguments():
    mgpu.init()
    with pytest.raises(ValueError, match="op='sum': expected one of mgpu.Average"):
        mgpu.allreduce(1.0, op="sum")
    with pytest.raises(TypeError, match="broadcast_object"):
        mgpu.allreduce("text")
    with pytest.raises(ValueError, match="root_rank=1 is not a rank of this job"):
        mgpu.broadcast(1, root_rank=1)


def test_shutdown_then_init_again():
    mgpu.init()
    mgpu.shutdown()
    assert not mgpu.is_initialized()
    with pytest.raises(mgpu.NotInitializedError):
        mgpu.size()
    mgpu.init()
    assert mgpu.size() == 1


def test_one_rank_decides_and_every_rank_raises_alike():
    # mgpu_launch.runtime.agreement on one process: the result, or the refusal's own error
    from mgpu_launch.runtime import agreement
    mgpu.init()
    refusals = {KeyError: lambda why: PermissionError(f"refused: {why}"),
                LookupError: lambda why: OSError(f"looked: {why}")}
    assert agreement.decided_by_root(None, lambda: 7, refusals) == 7

    def refuse(error):
        raise error
    with pytest.raises(PermissionError, match="refused: 'k'"):
        agreement.decided_by_root(None, lambda: refuse(KeyError("k")), refusals)
    with pytest.raises(OSError, match="looked: i"):   # the first matching type decides
        agreement.decided_by_root(None, lambda: refuse(IndexError("i")), refusals)
    with pytest.raises(ZeroDivisionError):             # a bug is not a refusal
        agreement.decided_by_root(None, lambda: 1 / 0, refusals)
    agreement.raise_any_rank(None, "", lambda rank, why: RuntimeError(why))
    with pytest.raises(RuntimeError, match="rank 0: broke"):
        agreement.raise_any_rank(None, "broke",
                                 lambda rank, why: RuntimeError(f"rank {rank}: {why}"))
