"""The JAX control plane: ranks started with JAX's variables, no MPI and no torchrun.

A JAX platform launcher, or a plain start of N processes, leaves ``JAX_COORDINATOR_ADDRESS``
(``host:port`` of process 0's host; JAX itself reads it), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` (:class:`mgpu_launch.config.environments.JaxProcesses`). Here every rank
calls ``jax.distributed.initialize`` with them (process 0 serves the coordination service,
bound to the address it is dialled at), within ``MGPU_JOIN_TIMEOUT`` seconds, and everything
the runtime says travels through that service's key-value store: each collective is the
ranks' keys under one sequence number, read by the others (``blocking_key_value_get_bytes``).
The JAX engine then finds jax.distributed up and uses it, instead of a coordinator of its own
(``mgpu_launch.backends.jax.engine``).

The store is made for small messages: the host collectives (metric averages, the job key,
the fit guard's checks, the first step's broadcast of rank 0's weights) go through the
coordinator, one copy per reader; the gradients do not (they travel in the compiled step).

The one runtime module besides transport_torch that imports a framework
(tests/test_architecture.py names it, with why): imported only when this plane is joined.
"""

import pickle
import socket
from typing import Any, List, Optional, Sequence

import numpy as np

from mgpu_launch.config import settings
from mgpu_launch.runtime import rendezvous
from mgpu_launch.runtime.transport import Transport

__all__ = ["PLANE", "JaxTransport", "join", "owns_jax_distributed"]

#: this plane's name (JaxProcesses.CONTROL_PLANE, the key of transport.TRANSPORTS)
PLANE = "jax.distributed"
_REDUCE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


class JaxTransport(Transport):
    """A group of ranks: keys ``<prefix>/<sequence>/<rank>`` in JAX's coordination service.

    Every collective takes the next sequence number on every rank of the group. Once a rank
    has read every rank's key of an allgather, every rank has finished every collective
    before it: the rank then deletes its own older keys, so the store does not grow with the
    job's length.
    """

    def __init__(self, client, prefix: str, rank: int, size: int, timeout_ms: int,
                 owned: bool):
        self.client, self.prefix = client, prefix
        self._rank, self._size, self._timeout_ms, self._owned = rank, size, timeout_ms, owned
        self._sequence = 0
        self._mine: List[str] = []  # own keys not yet known to be read by all, oldest first
        self._sent: dict = {}
        self._received: dict = {}

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
        return False  # the sequence numbers are one order of calls

    # -- the exchange every collective is made of ------------------------------------------------
    def _put(self, key: str, data: bytes) -> None:
        self.client.key_value_set_bytes(key, data)

    def _get(self, key: str) -> bytes:
        return self.client.blocking_key_value_get_bytes(key, self._timeout_ms)

    def _exchange(self, data: Optional[bytes], senders: Sequence[int]) -> List[bytes]:
        """Every rank in `senders` puts `data`; every rank reads theirs, in that order."""
        self._sequence += 1
        base = f"{self.prefix}/{self._sequence}"
        if self._rank in senders:
            self._put(f"{base}/{self._rank}", data)
            self._mine.append(f"{base}/{self._rank}")
        received = [data if rank == self._rank else self._get(f"{base}/{rank}")
                    for rank in senders]
        if len(senders) == self._size:
            # every rank has put its key of this one: each has read every key before it
            for key in self._mine[:-1]:
                self.client.key_value_delete(key)
            del self._mine[:-1]
        return received

    # -- objects --------------------------------------------------------------------------------
    def broadcast_object(self, obj: Any, root: int) -> Any:
        data = pickle.dumps(obj) if self._rank == root else None
        received = self._exchange(data, [root])[0]
        return obj if self._rank == root else pickle.loads(received)

    def allgather_object(self, obj: Any) -> List[Any]:
        gathered = self._exchange(pickle.dumps(obj), list(range(self._size)))
        return [obj if rank == self._rank else pickle.loads(data)
                for rank, data in enumerate(gathered)]

    def gather_object(self, obj: Any, root: int) -> Optional[List[Any]]:
        gathered = self.allgather_object(obj)  # every rank takes the same sequence number
        return gathered if self._rank == root else None

    def send_object(self, obj: Any, dest: int, tag: int) -> None:
        count = self._sent.get((dest, tag), 0)
        self._sent[dest, tag] = count + 1
        self._put(f"{self.prefix}/p2p/{self._rank}/{dest}/{tag}/{count}", pickle.dumps(obj))

    def receive_object(self, source: int, tag: int) -> Any:
        count = self._received.get((source, tag), 0)
        self._received[source, tag] = count + 1
        key = f"{self.prefix}/p2p/{source}/{self._rank}/{tag}/{count}"
        data = self._get(key)
        self.client.key_value_delete(key)
        return pickle.loads(data)

    def barrier(self) -> None:
        self.allgather_object(None)

    # -- numpy buffers --------------------------------------------------------------------------
    def allreduce_array(self, array: np.ndarray, op: str) -> np.ndarray:
        arrays = self.allgather_object(np.asarray(array))
        result = np.array(arrays[0], order="C")
        for other in arrays[1:]:  # rank order on every rank: the same result everywhere
            result = _REDUCE[op](result, other).astype(result.dtype, copy=False)
        return result

    def allgather_array(self, array: np.ndarray, rows: Sequence[int]) -> np.ndarray:
        return np.concatenate(self.allgather_object(np.asarray(array)), axis=0)

    def broadcast_array(self, array: np.ndarray, root: int) -> np.ndarray:
        return np.array(self.broadcast_object(np.asarray(array), root), order="C")

    # -- groups ---------------------------------------------------------------------------------
    def split(self, color: Optional[int], key: int) -> Optional["JaxTransport"]:
        entries = self.allgather_object((color, key))
        if color is None:
            return None
        members = [rank for _, rank in sorted((k, r) for r, (c, k) in enumerate(entries)
                                              if c == color)]
        return JaxTransport(self.client, f"{self.prefix}/s{self._sequence}/{color}",
                            members.index(self._rank), len(members), self._timeout_ms, False)

    def split_by_host(self) -> "JaxTransport":
        hosts = self.allgather_object(socket.gethostname())
        members = [r for r, host in enumerate(hosts) if host == hosts[self._rank]]
        return JaxTransport(self.client, f"{self.prefix}/h{self._sequence}",
                            members.index(self._rank), len(members), self._timeout_ms, False)

    def close(self) -> None:
        if self._owned:
            import jax
            from jax._src import distributed
            if distributed.global_state.client is not None:
                jax.distributed.shutdown()
        self.client = None


def owns_jax_distributed(transport) -> bool:
    """Whether `transport` started jax.distributed (the JAX engine then uses it instead of a
    coordinator of its own). Not a collective."""
    return isinstance(transport, JaxTransport) and transport._owned


def join(placement) -> JaxTransport:
    """This rank's transport: jax.distributed initialized at the placement's coordinator.

    Raises:
        RuntimeError: no coordinator address, jax.distributed already initialized by the
            script, or the ranks did not all join within ``MGPU_JOIN_TIMEOUT`` seconds.
    """
    if placement.coordinator_address is None:
        raise RuntimeError(
            f"{placement.source} started this job (process {placement.rank} of "
            f"{placement.size}) but JAX_COORDINATOR_ADDRESS is not host:port: the processes "
            f"meet at JAX's coordination service there. Set JAX_COORDINATOR_ADDRESS=<process "
            f"0's host>:<a free port> on every process.")
    import jax
    from jax._src import distributed
    if distributed.global_state.client is not None:
        raise RuntimeError(
            "jax.distributed is already initialized in this process; with JAX's variables "
            "mgpu.init() initializes it itself. Remove the jax.distributed.initialize call.")
    timeout = int(settings.seconds("MGPU_JOIN_TIMEOUT"))
    host, _ = rendezvous.host_and_port(placement.coordinator_address)
    bound = rendezvous.bind_address(placement.coordinator_address,
                                    rendezvous.host_address([host]))
    try:
        # Left alone, JAX's coordination service (no authentication) binds [::]:port.
        jax.distributed.initialize(placement.coordinator_address,
                                   num_processes=placement.size, process_id=placement.rank,
                                   initialization_timeout=timeout,
                                   coordinator_bind_address=bound)
    except Exception as error:  # jaxlib raises its own XlaRuntimeError types
        raise RuntimeError(
            f"process {placement.rank} of {placement.size} could not join JAX's coordination "
            f"service at {placement.coordinator_address} within {timeout} s "
            f"({type(error).__name__}: {error}). Start every process with the same "
            f"JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES, or raise MGPU_JOIN_TIMEOUT."
        ) from error
    timeout_ms = int(settings.seconds("MGPU_TORCH_TIMEOUT") * 1000)
    return JaxTransport(distributed.global_state.client, "mgpu", placement.rank,
                        placement.size, timeout_ms, owned=True)
