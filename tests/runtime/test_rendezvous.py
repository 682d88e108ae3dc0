"""The port a framework's server is promised (``rendezvous.reserved_port``): nothing else on the
host may take it before the server binds, yet the server itself can (CI, 2026-11-26: a TF rank
of an elastic restart could not start its gRPC server, the port picked a moment before was
taken by then)."""

import socket

from mgpu_launch.runtime.rendezvous import reserved_port


def _reuse_address_server(port: int) -> socket.socket:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", port))
    server.listen()
    return server


def test_no_other_socket_gets_the_reserved_port_while_it_is_held():
    with reserved_port() as port:
        with socket.socket() as plain:
            try:
                plain.bind(("", port))
                taken = False
            except OSError:
                taken = True
        assert taken, f"a plain bind took the reserved port {port}"
        picked = []
        for _ in range(2000):  # the kernel's own picks (as an outgoing connection's port)
            with socket.socket() as other:
                other.bind(("", 0))
                picked.append(other.getsockname()[1])
        assert port not in picked


def test_the_server_it_is_reserved_for_binds_and_serves_on_it():
    with reserved_port() as port:
        with _reuse_address_server(port) as server:
            with socket.create_connection(("127.0.0.1", port), timeout=10):
                connection, _ = server.accept()
                connection.close()


def test_the_port_is_free_again_after_the_block():
    with reserved_port() as port:
        pass
    with socket.socket() as plain:
        plain.bind(("", port))
