"""The torch.distributed control plane: ranks started by ``torchrun`` or a Kubeflow PyTorchJob.

Those starters share no MPI world; they leave ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (:class:`mgpu_launch.config.environments.TorchRun`). Here the ranks meet at
torch's ``TCPStore`` on ``MASTER_ADDR:MASTER_PORT`` (the one torchrun's agent serves; served by
rank 0 where no agent does, bound to the address it is dialled at), check that every rank
came within ``MGPU_JOIN_TIMEOUT`` seconds, and start torch.distributed's default process group
on it: gloo, and gloo + NCCL where CUDA is present. That group carries the host collectives
(CPU tensors: gloo), and the torch engine adopts it for the gradients instead of making its
own (``mgpu_launch.backends.torch.engine``). Point-to-point objects go through the store.
A split (a process set, a host's ranks) is a gloo group of its own on a prefix of the store.

The one runtime module that imports torch (tests/test_architecture.py names it, with why): the
control plane of a torchrun job is torch's own; it is imported only when that plane is
joined, so an MPI job or a one-process script never loads torch from here.
"""

import collections
import datetime
import os
import pickle
import socket
from typing import Any, List, Optional, Sequence

import numpy as np

from mgpu_launch.config import settings
from mgpu_launch.runtime import rendezvous
from mgpu_launch.runtime.transport import Transport

__all__ = ["PLANE", "TorchTransport", "join", "owns_torch_distributed"]

#: this plane's name (TorchRun.CONTROL_PLANE, the key of transport.TRANSPORTS)
PLANE = "torch.distributed"
_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PRODUCT"}


def _dist():
    import torch.distributed as dist
    return dist


def _tensor(array: np.ndarray):
    """A torch tensor sharing C-contiguous `array`'s memory (bfloat16 through its bits)."""
    import torch
    if array.dtype.name == "bfloat16":  # ml_dtypes' type: torch reads its bits as int16
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


class TorchTransport(Transport):
    """A group of ranks: a torch process group for collectives, a store prefix for messages.

    Args:
        group: the torch ``ProcessGroup`` (the default group) or gloo ``Backend`` (a split's).
        store: a store of this group alone (a prefix of the job's), for point-to-point objects.
        rank, size: this process's position in the group, and the group's size.
        owned: whether :meth:`close` ends torch.distributed (the job's transport) or only this
            group (a split).
    """

    def __init__(self, group, store, rank: int, size: int, timeout: datetime.timedelta,
                 owned: bool):
        self.group, self.store = group, store
        self._rank, self._size, self._timeout, self._owned = rank, size, timeout, owned
        self._sent: collections.Counter = collections.Counter()
        self._received: collections.Counter = collections.Counter()
        self._splits = 0

    @property
    def name(self) -> str:
        return PLANE

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def thread_safe(self) -> bool:
        return False  # one group: two threads' collectives would interleave on its pairs

    # -- tensors --------------------------------------------------------------------------------
    def _broadcast(self, tensor, root: int) -> None:
        dist = _dist()
        options = dist.BroadcastOptions()
        options.rootRank = root
        self.group.broadcast([tensor], options).wait()

    def _allgather(self, tensor) -> list:
        outputs = [tensor.new_empty(tensor.shape) for _ in range(self._size)]
        self.group.allgather([outputs], [tensor]).wait()
        return outputs

    def _gather_bytes(self, data: bytes) -> List[bytes]:
        import torch
        sizes = self._allgather(torch.tensor([len(data)], dtype=torch.int64))
        sizes = [int(s.item()) for s in sizes]
        padded = np.zeros(max(sizes) or 1, np.uint8)
        padded[:len(data)] = np.frombuffer(data, np.uint8)
        parts = self._allgather(torch.from_numpy(padded))
        return [part.numpy()[:n].tobytes() for part, n in zip(parts, sizes)]

    # -- objects --------------------------------------------------------------------------------
    def broadcast_object(self, obj: Any, root: int) -> Any:
        import torch
        data = pickle.dumps(obj) if self._rank == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._broadcast(size, root)
        buffer = np.zeros(int(size.item()), np.uint8)
        if self._rank == root:
            buffer[:] = np.frombuffer(data, np.uint8)
        self._broadcast(torch.from_numpy(buffer), root)
        return obj if self._rank == root else pickle.loads(buffer.tobytes())

    def allgather_object(self, obj: Any) -> List[Any]:
        return [pickle.loads(data) for data in self._gather_bytes(pickle.dumps(obj))]

    def gather_object(self, obj: Any, root: int) -> Optional[List[Any]]:
        gathered = self.allgather_object(obj)  # gloo's gather needs equal sizes: an allgather
        return gathered if self._rank == root else None

    def send_object(self, obj: Any, dest: int, tag: int) -> None:
        count = self._sent[dest, tag]
        self._sent[dest, tag] += 1
        self.store.set(f"p2p/{self._rank}/{dest}/{tag}/{count}", pickle.dumps(obj))

    def receive_object(self, source: int, tag: int) -> Any:
        count = self._received[source, tag]
        self._received[source, tag] += 1
        key = f"p2p/{source}/{self._rank}/{tag}/{count}"
        data = self.store.get(key)  # waits for it (the store's timeout)
        self.store.delete_key(key)
        return pickle.loads(data)

    def barrier(self) -> None:
        import torch
        self._allgather(torch.zeros(1, dtype=torch.uint8))  # gloo's barrier, as a collective

    # -- numpy buffers --------------------------------------------------------------------------
    def allreduce_array(self, array: np.ndarray, op: str) -> np.ndarray:
        dist = _dist()
        result = np.array(array, order="C")  # a copy: the reduction is in place
        if not result.size:
            return result
        options = dist.AllreduceOptions()
        options.reduceOp = getattr(dist.ReduceOp, _OPS[op])
        self.group.allreduce([_tensor(result.reshape(-1))], options).wait()
        return result

    def allgather_array(self, array: np.ndarray, rows: Sequence[int]) -> np.ndarray:
        import torch
        row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.itemsize
        own = _bytes(np.array(array, order="C"))
        padded = np.zeros(max(max(rows) * row_bytes, 1), np.uint8)
        padded[:own.size] = own
        parts = self._allgather(torch.from_numpy(padded))
        joined = np.concatenate([part.numpy()[:n * row_bytes] for part, n in zip(parts, rows)])
        return joined.view(array.dtype).reshape((sum(rows),) + array.shape[1:])

    def broadcast_array(self, array: np.ndarray, root: int) -> np.ndarray:
        import torch
        result = np.array(array, order="C")
        if result.size:
            self._broadcast(torch.from_numpy(_bytes(result)), root)
        return result

    # -- groups ---------------------------------------------------------------------------------
    def split(self, color: Optional[int], key: int) -> Optional["TorchTransport"]:
        entries = self.allgather_object((color, key))
        self._splits += 1
        if color is None:
            return None
        members = [rank for _, rank in sorted((k, r) for r, (c, k) in enumerate(entries)
                                              if c == color)]
        return self._group_of(f"split/{self._splits}/{color}", members)

    def split_by_host(self) -> "TorchTransport":
        hosts = self.allgather_object(socket.gethostname())
        self._splits += 1
        members = [r for r, host in enumerate(hosts) if host == hosts[self._rank]]
        return self._group_of(f"split/{self._splits}/host", members)

    def _group_of(self, prefix: str, members: List[int]) -> "TorchTransport":
        """This rank's gloo group of `members` (ranks of this group, in the new group's order),
        its store a prefix of this one: made by the members alone."""
        dist = _dist()
        store = dist.PrefixStore(prefix + "/", self.store)
        position = members.index(self._rank)
        group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), position, len(members),
                                      self._timeout)
        return TorchTransport(group, store, position, len(members), self._timeout, owned=False)

    def close(self) -> None:
        dist = _dist()
        if self._owned and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None


def owns_torch_distributed(transport) -> bool:
    """Whether `transport` started torch.distributed's default group (the torch engine then
    adopts that group instead of making its own). Not a collective."""
    return isinstance(transport, TorchTransport) and transport._owned


def _restart_prefix() -> str:
    """Keys of this attempt alone: torchrun's agent keeps its store across ``--max-restarts``."""
    return f"mgpu/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _store(placement, host: str, port: int, timeout: datetime.timedelta):
    """The job's TCPStore: a client of torchrun's agent's, else rank 0 serves it."""
    dist = _dist()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or placement.rank != 0:
        return dist.TCPStore(host, port, placement.size, False, timeout)
    address = placement.coordinator_address
    listener = rendezvous.listen(address, rendezvous.host_address([host]))
    return dist.TCPStore(host, port, placement.size, True, timeout,
                         master_listen_fd=listener.detach())


def _wait_for_everyone(store, placement, timeout: datetime.timedelta) -> None:
    """Every rank checks in; a rank missing after `timeout` is named, on every rank there."""
    store.set(f"joined/{placement.rank}", "1")
    keys = [f"joined/{rank}" for rank in range(placement.size)]
    try:
        store.wait(keys, timeout)
    except Exception as error:  # torch raises its own DistStoreError / RuntimeError
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(
            f"rank {placement.rank}: ranks {missing} of {placement.size} did not join the "
            f"torch.distributed store at {placement.coordinator_address} within "
            f"{timeout.total_seconds():g} s ({type(error).__name__}). Start every rank (torchrun "
            f"--nnodes/--nproc-per-node must add up to WORLD_SIZE), or raise "
            f"MGPU_JOIN_TIMEOUT.") from error


def join(placement) -> TorchTransport:
    """This rank's transport: torch.distributed started at the placement's coordinator.

    Raises:
        RuntimeError: no coordinator (``MASTER_ADDR`` / ``MASTER_PORT`` missing or not a
            number), torch.distributed already initialized by the script, the store cannot be
            reached, or a rank did not join within ``MGPU_JOIN_TIMEOUT`` seconds.
    """
    if placement.coordinator_address is None:
        raise RuntimeError(
            f"{placement.source} started this job (RANK={placement.rank}, "
            f"WORLD_SIZE={placement.size}) but MASTER_ADDR / MASTER_PORT are not both set (the "
            f"port a number): the ranks meet at torch's TCP store there. Start the job with "
            f"torchrun, or set MASTER_ADDR=<rank 0's host> and MASTER_PORT=<a free port> on "
            f"every rank.")
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process; under torchrun "
            "mgpu.init() starts it itself from torchrun's variables (and the torch engine uses "
            "that group). Remove the init_process_group call: after mgpu.init(), the default "
            "group is the job's.")
    host, port = rendezvous.host_and_port(placement.coordinator_address)
    join_timeout = datetime.timedelta(seconds=settings.seconds("MGPU_JOIN_TIMEOUT"))
    timeout = datetime.timedelta(seconds=settings.seconds("MGPU_TORCH_TIMEOUT"))
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds this host's own name resolved, 127.0.1.1 on Debian: take the interface
        # that reaches the coordinator instead (on one host, loopback's)
        interface = rendezvous.interface_toward(host)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        base = _store(placement, host, port, join_timeout)
    except Exception as error:
        raise RuntimeError(
            f"rank {placement.rank} could not reach torch's TCP store at "
            f"{placement.coordinator_address} within {join_timeout.total_seconds():g} s "
            f"({type(error).__name__}: {error}). Check MASTER_ADDR / MASTER_PORT (rank 0's "
            f"host, reachable from every rank), or raise MGPU_JOIN_TIMEOUT.") from error
    store = dist.PrefixStore(_restart_prefix(), base)
    _wait_for_everyone(store, placement, join_timeout)
    store.set_timeout(timeout)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("group/", store),
                            rank=placement.rank, world_size=placement.size, timeout=timeout)
    return TorchTransport(dist.group.WORLD, dist.PrefixStore("world/", store), placement.rank,
                          placement.size, timeout, owned=True)
