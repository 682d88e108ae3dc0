"""Functions for tests/runtime/test_launch.py to start with mgpu_launch.run (importable by the
ranks)."""

import os


def rank_and_size(offset, scale=1):
    import mgpu_launch as mgpu
    mgpu.init()
    return {"rank": mgpu.rank(), "size": mgpu.size(), "value": (offset + mgpu.rank()) * scale,
            "pid": os.getpid()}


def fail_on_rank_one():
    import mgpu_launch as mgpu
    mgpu.init()
    if mgpu.rank() == 1:
        raise KeyError("no such shard on rank 1")
    mgpu.barrier()  # rank 0 would wait here forever if the failure did not end the job
    return "unreachable"


def hang(pid_prefix):
    """Write this rank's pid to PID_PREFIX.<rank>, then never return (no mgpu.init: fast)."""
    import time
    with open(f"{pid_prefix}.{os.environ['MGPU_RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def broadcast_rank_0s():
    """A host collective (recorded by the timeline): rank 0's {"rank": 0} on every rank."""
    import mgpu_launch as mgpu
    mgpu.init()
    return mgpu.broadcast_object({"rank": mgpu.rank()}, root_rank=0)
