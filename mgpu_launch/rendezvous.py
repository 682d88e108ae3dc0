"""Addresses the ranks can meet at: the rendezvous every engine's framework set-up starts from.

Framework-free (sockets and the MPI communicator only), below the engines: each engine asks
for a ``host:port`` here and hands it to its framework (JAX's coordinator, torch's TCP store,
TensorFlow's servers).
"""

import os
import socket


def free_port() -> int:
    """A TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def host_address() -> str:
    """This host's address as the other hosts would dial it (its name resolved)."""
    return socket.gethostbyname(socket.gethostname())


def rendezvous_address(state, override_variable: str, timeout: float = 60.0) -> str:
    """A ``host:port`` on rank 0's host that every rank has proved it can connect to.

    Rank 0 picks a free port (or the address in `override_variable`), MPI shares it, rank 0
    listens on it and every rank opens a TCP connection within `timeout` seconds; the results
    are shared, so an unreachable address is one clear error on every rank instead of a
    framework's hang or C++ abort. The listener is closed again for the framework to bind.

    Raises:
        RuntimeError: naming the first rank that could not connect, and why.
    """
    comm = state.comm
    address = None
    if state.rank == 0:
        address = os.environ.get(override_variable)
        if not address:
            address = f"{host_address()}:{free_port()}"
    address = comm.bcast(address, root=0)
    host, _, port = address.rpartition(":")
    listener, problem = None, None
    if state.rank == 0:
        try:
            listener = socket.create_server(("", int(port)))
        except (OSError, ValueError) as error:
            problem = f"rank 0 cannot listen on port {port!r} ({error})"
    problem = comm.bcast(problem, root=0)
    if problem is None:
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                pass
        except (OSError, ValueError) as error:
            problem = f"cannot connect to it ({type(error).__name__}: {error or 'timed out'})"
    problems = comm.allgather(problem)
    if listener is not None:
        listener.close()
    failed = [(rank, text) for rank, text in enumerate(problems) if text]
    if failed:
        rank, text = failed[0]
        raise RuntimeError(
            f"the rendezvous address {address} does not work: rank {rank} {text} "
            f"({len(failed)} of {len(problems)} ranks failed, within {timeout:g} s). Every rank "
            f"must reach rank 0's host on that port: check the firewall, or set "
            f"{override_variable}=host:port to an address of rank 0's host.")
    return address
