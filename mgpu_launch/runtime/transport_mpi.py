"""The MPI control plane: :class:`~mgpu_launch.runtime.transport.Transport` over mpi4py.

The one module that imports mpi4py and holds a communicator. Its ranks are the processes of
``MPI_COMM_WORLD``: started by ``mgpu-train -np N``, ``mpirun``/``mpiexec`` or ``srun
--mpi=pmix``. :func:`join` checks that MPI and the launcher's variables describe the same job,
and works on a duplicate of ``COMM_WORLD``, so a user's own MPI traffic never meets ours.
"""

from typing import Any, List, Optional, Sequence

import numpy as np

from mgpu_launch.runtime.transport import Transport

__all__ = ["MPITransport", "join"]


def _mpi():
    from mpi4py import MPI  # initializes MPI (thread level "multiple") on first import
    return MPI


def _bytes(array: np.ndarray) -> np.ndarray:
    """A C-contiguous `array`'s buffer as bytes (a view, 0-d arrays too): MPI moves any dtype
    (bfloat16 too) without knowing it."""
    return array.reshape(-1).view(np.uint8)


class MPITransport(Transport):
    """A group of ranks as one mpi4py communicator (owned: :meth:`close` frees it)."""

    def __init__(self, comm):
        self.comm = comm

    @property
    def name(self) -> str:
        return "mpi"

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def thread_safe(self) -> bool:
        mpi = _mpi()
        return mpi.Query_thread() == mpi.THREAD_MULTIPLE

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj: Any) -> List[Any]:
        return self.comm.allgather(obj)

    def gather_object(self, obj: Any, root: int) -> Optional[List[Any]]:
        return self.comm.gather(obj, root=root)

    def send_object(self, obj: Any, dest: int, tag: int) -> None:
        self.comm.send(obj, dest=dest, tag=tag)

    def receive_object(self, source: int, tag: int) -> Any:
        return self.comm.recv(source=source, tag=tag)

    def barrier(self) -> None:
        self.comm.Barrier()

    def allreduce_array(self, array: np.ndarray, op: str) -> np.ndarray:
        mpi = _mpi()
        mpi_op = {"sum": mpi.SUM, "min": mpi.MIN, "max": mpi.MAX, "product": mpi.PROD}[op]
        result = np.empty_like(array)
        self.comm.Allreduce(np.asarray(array, order="C"), result, op=mpi_op)
        return result

    def allgather_array(self, array: np.ndarray, rows: Sequence[int]) -> np.ndarray:
        row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.itemsize
        result = np.empty((sum(rows),) + array.shape[1:], array.dtype)
        self.comm.Allgatherv(_bytes(np.asarray(array, order="C")),
                             [_bytes(result), [n * row_bytes for n in rows]])
        return result

    def broadcast_array(self, array: np.ndarray, root: int) -> np.ndarray:
        result = np.array(array, order="C")  # a copy; np.ascontiguousarray makes 0-d arrays 1-d
        self.comm.Bcast(_bytes(result), root=root)
        return result

    def split(self, color: Optional[int], key: int) -> Optional["MPITransport"]:
        # collective over every rank: a rank without a color gets COMM_NULL and keeps nothing
        sub = self.comm.Split(color=_mpi().UNDEFINED if color is None else color, key=key)
        return None if color is None else MPITransport(sub)

    def split_by_host(self) -> "MPITransport":
        return MPITransport(self.comm.Split_type(_mpi().COMM_TYPE_SHARED, key=self.rank))

    def close(self) -> None:
        if not _mpi().Is_finalized():
            self.comm.Free()


def join(placement) -> MPITransport:
    """This rank's transport over MPI's ``COMM_WORLD`` (a duplicate), checked against the
    launcher's `placement`.

    Raises:
        RuntimeError: MPI's world has another size than the placement (the ranks were started
            by a launcher that does not start MPI), or another rank for this process.
    """
    world = _mpi().COMM_WORLD
    if world.Get_size() != placement.size:
        raise RuntimeError(
            f"{placement.source} says this job has {placement.size} processes but MPI's "
            f"COMM_WORLD has {world.Get_size()}: mgpu-launch talks over MPI, so start the job "
            f"with mgpu-train -np N, mpirun, or srun --mpi=pmix, not with a launcher that "
            f"does not start MPI")
    if world.Get_rank() != placement.rank:
        raise RuntimeError(f"{placement.source} says rank {placement.rank} but MPI says "
                           f"{world.Get_rank()}: the launcher variables are stale")
    return MPITransport(world.Dup())
