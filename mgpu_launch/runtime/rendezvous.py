"""Addresses the ranks can meet at: the rendezvous every engine's framework set-up starts from.

Framework-free (sockets and the runtime's transport only), below the engines: each engine asks
for a ``host:port`` here and hands it to its framework (JAX's coordinator, torch's TCP store,
TensorFlow's servers).
"""

import contextlib
import errno
import ipaddress
import socket
from typing import Iterator, Optional, Sequence, Tuple

from mgpu_launch.config import settings
from mgpu_launch.runtime import agreement


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A TCP port held for a server this process starts inside the ``with`` block.

    A port found free and let go at once may be taken before the framework binds it (an
    outgoing connection's ephemeral port, another rank's pick: its server then fails to
    start; seen in CI at an elastic restart). Here the port stays bound, with
    ``SO_REUSEADDR`` and never listening, until the block ends: the kernel hands it to no
    other socket, yet a server that also sets ``SO_REUSEADDR`` (gRPC's do) binds and listens
    on it.

    Yields:
        The port number.

    Example:
        >>> with reserved_port() as port:
        ...     server = socket.socket()
        ...     server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ...     server.bind(("", port)); server.listen(); server.close()
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))
        yield sock.getsockname()[1]


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _resolve(name: str) -> Optional[str]:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def host_address(peers: Sequence[str] = ()) -> str:
    """This host's IPv4 address as the hosts named in `peers` would dial it.

    Its own name resolved, when that is not a loopback address. Debian and Ubuntu map a host's
    own name to 127.0.1.1 in /etc/hosts, which no other host can dial: then the address this
    host sends from when it reaches the first resolvable peer (the kernel's route choice; no
    packet is sent). With no usable peer, loopback: right when every rank is on this host.

    Args:
        peers: names of the other hosts of the job (an empty sequence: a one-host job).

    Returns:
        A dotted IPv4 address.

    Example:
        On node1 of scripts/cluster.sh (whose /etc/hosts says ``127.0.1.1 node1``):

        >>> host_address(["node2"])  # doctest: +SKIP
        '10.213.0.1'
    """
    own = _resolve(socket.gethostname())
    if own and not _is_loopback(own):
        return own
    for peer in peers:
        peer_address = _resolve(peer)
        if not peer_address or _is_loopback(peer_address):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((peer_address, 9))  # UDP connect: picks a route, sends nothing
            except OSError:
                continue
            return probe.getsockname()[0]
    return own or "127.0.0.1"


def job_host_address(state) -> str:
    """Collective: this host's address as the job's OTHER hosts dial it (see host_address).

    Every rank must call it (the ranks exchange their host names over the transport), the
    first time;
    the answer is kept in ``state.host_address`` for the stall inspector and the engines.
    """
    if state.host_address is None:
        own = socket.gethostname()
        names = (state.transport.allgather_object(own) if state.transport is not None
                 else [own])
        state.host_address = host_address(sorted(set(names) - {own}))
    return state.host_address


def interface_of(address: str) -> Optional[str]:
    """Name of the network interface that holds IPv4 `address` (Linux), or None.

    gloo (JAX's and torch's CPU collectives) binds to an interface rather than an address
    (GLOO_SOCKET_IFNAME); this maps the address chosen by :func:`job_host_address` to it.
    """
    import fcntl
    import struct

    siocgifaddr = 0x8915
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr,
                                     struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def interface_toward(host: str) -> Optional[str]:
    """The interface holding the address this host reaches `host` from (see
    :func:`host_address`), or None: what gloo must bind (``GLOO_SOCKET_IFNAME``) where this
    host's own name resolves to 127.0.1.1, which the other hosts cannot dial."""
    return interface_of(host_address([host]))


def bind_host(dial_host: str, job_host: Optional[str] = None) -> str:
    """The address a listener of this job binds on rank 0's host: ``MGPU_BIND_ADDRESS``, else
    the address `dial_host` (what the other ranks dial) stands for here; never every interface
    by default.

    A listener bound to the address it is dialled at is reachable by the job, and by no one on
    the host's other networks. A host name is resolved; where it resolves to a loopback address
    (Debian's ``127.0.1.1 node1``) that other hosts cannot dial, `job_host` (the job's host
    address, :func:`job_host_address`) is bound instead, unless that is loopback too.
    ``MGPU_BIND_ADDRESS=0.0.0.0`` is for hosts where the dialled address is not one of the
    host's own (NAT, a Kubernetes service name).

    Raises:
        settings.SettingError: ``MGPU_BIND_ADDRESS`` is not an IPv4 address (an IPv6 one is
            refused with the reason: the listeners are IPv4 sockets).

    Example:
        >>> bind_host("10.0.0.1")  # MGPU_BIND_ADDRESS unset
        '10.0.0.1'
    """
    chosen = settings.text("MGPU_BIND_ADDRESS")  # an IPv4 address: the setting's own check
    if chosen is not None:
        return chosen
    try:
        ipaddress.ip_address(dial_host)
        return dial_host
    except ValueError:
        pass
    resolved = _resolve(dial_host)
    if resolved and _is_loopback(resolved) and job_host and not _is_loopback(job_host):
        return job_host
    return resolved or dial_host


def dial_host(job_host: str, chosen: Optional[str]) -> str:
    """The address the ranks dial for a listener on rank 0's host: ``MGPU_BIND_ADDRESS``
    (`chosen`) when it names one address, since the listener is bound there and nowhere else
    (127.0.0.2 is reachable on its host only at 127.0.0.2); else `job_host`, the job's host
    address (:func:`job_host_address`), also for ``0.0.0.0`` (every interface)."""
    if chosen and not ipaddress.ip_address(chosen).is_unspecified:
        return chosen
    return job_host


def bind_problem(chosen: Optional[str], host_names: Sequence[str]) -> Optional[str]:
    """Why ``MGPU_BIND_ADDRESS`` (`chosen`) cannot work for a job whose ranks run on the hosts
    `host_names`, or None: a loopback address is reachable from its own host only, so it is
    refused for a job on several hosts."""
    names = sorted(set(host_names))
    if not chosen or not _is_loopback(chosen) or len(names) < 2:
        return None
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return (f"MGPU_BIND_ADDRESS={chosen} is a loopback address, but the job runs on "
            f"{len(names)} hosts ({shown}): the ranks on the other hosts could never reach rank "
            f"0's listeners there. Unset MGPU_BIND_ADDRESS (the job's host address is bound), "
            f"or set it to rank 0's address on the job's network")


def checked_bind(state, job_host: str) -> Tuple[str, str]:
    """Collective: (the address rank 0's listeners bind, the address every rank dials them at),
    after checking that ``MGPU_BIND_ADDRESS`` can be reached by every rank of the job.

    Raises:
        RuntimeError: on every rank alike, ``MGPU_BIND_ADDRESS`` is a loopback address and the
            ranks run on several hosts (:func:`bind_problem`).
        settings.SettingError: ``MGPU_BIND_ADDRESS`` is not an IPv4 address.
    """
    bound = bind_host(job_host)
    chosen = settings.text("MGPU_BIND_ADDRESS")
    own = socket.gethostname()
    names = state.transport.allgather_object(own) if state.transport is not None else [own]
    problem = bind_problem(chosen, names)
    if problem:
        raise RuntimeError(problem)
    return bound, dial_host(job_host, chosen)


def listen_problem(bound: str, error: OSError) -> Optional[str]:
    """Advice for a listener that could not bind `bound` when the address, not the port, is
    what is wrong (it is none of this host's), else None."""
    if error.errno != errno.EADDRNOTAVAIL:
        return None
    return (f"MGPU_BIND_ADDRESS={bound} is not an address of rank 0's host "
            f"({socket.gethostname()}): {error.strerror}. Set it to one of that host's "
            f"addresses (`ip -4 addr`), to 0.0.0.0 for every interface, or unset it")


def host_and_port(address: str) -> Tuple[str, int]:
    """``(host, port)`` of a ``host:port`` (an IPv6 host may be written in brackets)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def bind_address(address: str, job_host: Optional[str] = None) -> str:
    """The ``host:port`` a framework's listener for `address` binds (see :func:`bind_host`)."""
    host, port = host_and_port(address)
    host = bind_host(host, job_host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(address: str, job_host: Optional[str] = None) -> socket.socket:
    """A TCP socket listening on `address`'s port, bound to :func:`bind_host` of its host.

    Raises:
        OSError: the address cannot be bound (not one of this host's, or the port is taken).
    """
    host, port = host_and_port(bind_address(address, job_host))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


@contextlib.contextmanager
def rendezvous(state, override_variable: str, timeout: float = 60.0) -> Iterator[str]:
    """A ``host:port`` on rank 0's host that every rank has proved it can connect to.

    Rank 0 picks a free port (or the address in `override_variable`), the transport shares
    it, rank 0
    listens on it and every rank opens a TCP connection within `timeout` seconds; the results
    are shared, so an unreachable address is one clear error on every rank instead of a
    framework's hang or C++ abort. The listener is closed again for the framework to bind,
    which it must do inside the ``with`` block: a port rank 0 picked stays reserved for it
    until the block ends (:func:`reserved_port`). It binds the address's own host
    (:func:`bind_host`), as the framework's listener must.

    Yields:
        The address, the same on every rank.

    Raises:
        RuntimeError: naming the first rank that could not connect, and why.
        settings.SettingError: ``MGPU_BIND_ADDRESS`` is not an IPv4 address (on every rank).

    Example:
        >>> with rendezvous(state, "MGPU_TORCH_ADDRESS") as address:  # doctest: +SKIP
        ...     dist.init_process_group("gloo", init_method=f"tcp://{address}", ...)
    """
    with contextlib.ExitStack() as held:
        yield _meet(state, override_variable, timeout, held)


class _NotThisHost(Exception):
    """Rank 0 cannot listen because ``MGPU_BIND_ADDRESS`` is none of its host's addresses."""


def _meet(state, override_variable: str, timeout: float, held: contextlib.ExitStack) -> str:
    transport = state.transport
    host = job_host_address(state)
    dial = checked_bind(state, host)[1]  # every rank: a bad MGPU_BIND_ADDRESS fails them all

    def pick() -> str:  # rank 0: an MGPU_* HOST:PORT (checked), else a port held for the framework
        return settings.text(override_variable) or f"{dial}:{held.enter_context(reserved_port())}"

    address = agreement.decided_by_root(transport, pick, {})
    bound = bind_address(address, host)

    def unreachable(rank: int, text: str, failed: int = 1) -> RuntimeError:
        return RuntimeError(
            f"the rendezvous address {address} does not work: rank {rank} {text} "
            f"({failed} of {state.size} ranks failed, within {timeout:g} s). Every rank "
            f"must reach rank 0's host on that port: check the firewall, or set "
            f"{override_variable}=host:port to an address of rank 0's host.")

    def cannot_listen(why: str) -> RuntimeError:
        return unreachable(0, f"cannot listen on {bound} ({why}; MGPU_BIND_ADDRESS=0.0.0.0 "
                              f"binds every interface)")

    listener = None

    def listen_on_rank_0() -> None:
        nonlocal listener
        try:
            listener = listen(address, host)
        except OSError as error:  # the address, not the port, may be what is wrong
            advice = listen_problem(bound, error)
            if advice:
                raise _NotThisHost(advice) from error
            raise

    agreement.decided_by_root(transport, listen_on_rank_0, {
        _NotThisHost: lambda advice: unreachable(0, advice),
        OSError: cannot_listen, ValueError: cannot_listen})
    problem = ""
    try:
        with socket.create_connection(host_and_port(address), timeout=timeout):
            pass
    except (OSError, ValueError) as error:
        problem = f"cannot connect to it ({type(error).__name__}: {error or 'timed out'})"
    failed = agreement.failures(transport, problem)
    if listener is not None:
        listener.close()
    if failed:
        raise unreachable(*failed[0], failed=len(failed))
    return address
