"""The stall inspector's side channel: positions from every rank to rank 0, over TCP.

It does not need the MPI communicator to be free (a stalled collective holds it). Rank 0's
:class:`PositionServer` listens on the job's host address; each other rank's
:class:`Reporter` thread connects once, proves the job key and sends its position when it
changed. Every byte a connection sends passes mgpu_launch.runtime.auth first (the job key's
challenge, HMAC-signed lines, the message schema, a line length limit, a deadline for the
hello): a connection that fails any of it is closed, and nothing else changes, so the positions
the inspector compares are only ever those the ranks themselves sent.
"""

import faulthandler
import selectors
import socket
import sys
import threading
import time
from typing import Callable, Dict, Tuple

from mgpu_launch.runtime import auth

Position = Tuple[int, int, str]


class PositionServer:
    """Rank 0's listener and its connections; :meth:`poll` returns the ranks' positions.

    Not thread-safe: one thread calls :meth:`poll`, :meth:`ask_for_stacks` and :meth:`close`;
    :meth:`wake` may be called from any thread.

    Args:
        host: the address to listen on (the job's host address, not every interface).
        port: the port; 0 for any free one (then see :attr:`port`).
        key: the job key the ranks must prove.
        size: the job's size (ranks 1..size-1 may connect).

    Raises:
        OSError: the address cannot be listened on.
    """

    #: connections that have not proved the key yet, at most (the oldest is closed first)
    MAX_PENDING = 16

    def __init__(self, host: str, port: int, key: bytes, size: int):
        self.listener = socket.create_server((host, port), backlog=max(size, 64))
        self.port = self.listener.getsockname()[1]
        self.key, self.size = key, size
        self.peers: Dict[socket.socket, auth.ServerPeer] = {}
        self.connections: Dict[int, socket.socket] = {}  # authenticated rank -> its socket
        self.wake_up, self.waker = socket.socketpair()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_up, selectors.EVENT_READ)

    def poll(self, timeout: float) -> Dict[int, Position]:
        """Wait up to `timeout` s for traffic; the newest position of each rank that sent one.

        Raises:
            OSError: the listener itself failed (a bad connection never raises).
        """
        received: Dict[int, Position] = {}
        for key, _ in self.selector.select(timeout):
            if key.fileobj is self.listener:
                self._accept()
            elif key.fileobj is self.wake_up:
                self.wake_up.recv(64)
            else:
                self._receive(key.fileobj, received)
        now = time.monotonic()
        for sock, peer in list(self.peers.items()):
            if peer.rank is None and now > peer.deadline:
                self._drop(sock)
        return received

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:  # the client gave up already, or no file descriptor is left
            time.sleep(0.01)
            return
        peer = auth.ServerPeer(self.key, self.size)
        try:
            sock.settimeout(1.0)  # sends are small: a peer that reads nothing costs 1 s at most
            sock.sendall(peer.greeting)
            self.selector.register(sock, selectors.EVENT_READ)
        except (OSError, ValueError):
            sock.close()
            return
        self.peers[sock] = peer
        pending = [other for other, state in self.peers.items() if state.rank is None]
        if len(pending) > self.MAX_PENDING:
            self._drop(pending[0])  # dicts keep insertion order: the oldest

    def _receive(self, sock: socket.socket, received: Dict[int, Position]) -> None:
        peer = self.peers[sock]
        try:
            reply, positions = peer.feed(sock.recv(65536))
            if reply:
                sock.sendall(reply)
        except (OSError, auth.Rejected):
            self._drop(sock)
            return
        if peer.rank is not None:
            self.connections[peer.rank] = sock
            if positions:
                received[peer.rank] = positions[-1]

    def _drop(self, sock: socket.socket) -> None:
        peer = self.peers.pop(sock, None)
        if peer is not None and self.connections.get(peer.rank) is sock:
            del self.connections[peer.rank]
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def ask_for_stacks(self, rank: int) -> None:
        """Ask `rank` to print its Python stacks (nothing when it is not connected)."""
        sock = self.connections.get(rank)
        if sock is not None:
            try:
                sock.sendall(self.peers[sock].seal({"request": "stacks"}))
            except OSError:
                self._drop(sock)

    def wake(self) -> None:
        """Make a waiting :meth:`poll` return now (from another thread)."""
        try:
            self.waker.send(b"x")
        except OSError:
            pass

    def close(self) -> None:
        """Close the listener and every connection."""
        for sock in list(self.peers):
            self._drop(sock)
        for sock in (self.listener, self.wake_up, self.waker):
            sock.close()
        self.selector.close()


class Reporter(threading.Thread):
    """A non-zero rank's side: sends its position when it changed, answers stack requests.

    Args:
        rank: this rank.
        channel: its authenticated connection to rank 0 (:func:`mgpu_launch.runtime.auth.connect`).
        position: returns this rank's current position.
        interval: seconds between two looks at the position.
    """

    def __init__(self, rank: int, channel: auth.ClientChannel,
                 position: Callable[[], Position], interval: float = 0.5):
        super().__init__(name="mgpu-stall-reporter", daemon=True)
        self.rank, self.channel, self.position = rank, channel, position
        self.interval, self.stopped = interval, threading.Event()

    def run(self) -> None:
        sent = None
        sock = self.channel.sock
        selector = selectors.DefaultSelector()
        try:
            selector.register(sock, selectors.EVENT_READ)
            while not self.stopped.is_set():
                where = self.position()
                if where != sent:
                    step, phase, detail = where
                    self.channel.send({"rank": self.rank,
                                       "position": [step, phase, detail[:auth.MAX_DETAIL]]})
                    sent = where
                if selector.select(self.interval):
                    data = sock.recv(4096)
                    if not data:
                        return  # rank 0 went away: the job is ending
                    for _ in self.channel.receive(data):  # "stacks", the only request
                        print(f"mgpu: stall: rank {self.rank}'s Python stacks (asked by rank 0):",
                              file=sys.stderr, flush=True)
                        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError):  # ValueError: _auth.Rejected, or the socket was closed
            return
        finally:
            selector.close()
            sock.close()

    def stop(self) -> None:
        self.stopped.set()
        try:
            self.channel.sock.shutdown(socket.SHUT_RDWR)  # wakes run(), which closes it
        except OSError:
            pass
        if self.is_alive() and self is not threading.current_thread():
            self.join(2 * self.interval)
