"""The stall inspector's side channel: positions from every rank to rank 0, over TCP.

It does not need the MPI communicator to be free (a stalled collective holds it). Rank 0's
:class:`PositionServer` listens on the job's host address; each other rank's
:class:`Reporter` thread connects once, proves the job key and sends its position when it
changed. Every byte a connection sends passes mgpu_launch.runtime.auth first (the job key's
challenge, HMAC-signed lines, the message schema, a line length limit, a deadline for the
hello): a connection that fails any of it is closed, and nothing else changes, so the positions
the inspector compares are only ever those the ranks themselves sent.

Connections from outside the job cannot switch the inspector off either: at most
:attr:`PositionServer.MAX_PENDING` connections wait for their hello, each new one is safe from
eviction for :attr:`PositionServer.ANSWER_GRACE_S` (a rank answers in one round trip; when all
are that new, the newcomer is turned away instead), a pass reads before it evicts, a full set
turns away another local user's newcomers at once (their sockets' owner, from /proc) and lets a
connection of this user (a rank on this host) in by evicting one of another local user's, and
a rank turned away keeps trying with back-off for the job's life (:class:`Reporter`). Rank 0
warns when a rank has not got in (``stall.Monitor``): a rank out of the inspector is never
silent.
"""

import faulthandler
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple

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

    #: connections that have not proved the key yet, at most
    MAX_PENDING = 16
    #: seconds a new connection is never evicted for a newer one: a rank answers the greeting
    #: in one round trip, so a flood of newer connections cannot push it out before it does
    ANSWER_GRACE_S = 2.0

    def __init__(self, host: str, port: int, key: bytes, size: int):
        self.listener = socket.create_server((host, port), backlog=max(size, 64))
        self.port = self.listener.getsockname()[1]
        self.key, self.size = key, size
        self.peers: Dict[socket.socket, auth.ServerPeer] = {}
        self.connections: Dict[int, socket.socket] = {}  # authenticated rank -> its socket
        self.joined: Set[int] = set()  # every rank that was authenticated once
        self.owners: Dict[socket.socket, Optional[int]] = {}  # see _owner
        self.wake_up, self.waker = socket.socketpair()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.wake_up, selectors.EVENT_READ)

    def poll(self, timeout: float) -> Dict[int, Position]:
        """Wait up to `timeout` s for traffic; the newest position of each rank that sent one.

        One pass reads every connection that has data first, and only then accepts a new one
        (which may evict a waiting one): a connection is never evicted between being reported
        ready and being read (issue 37: that KeyError killed the monitor thread).

        Raises:
            OSError: the listener itself failed (a bad connection never raises).
        """
        received: Dict[int, Position] = {}
        ready = [key.fileobj for key, _ in self.selector.select(timeout)]
        for sock in ready:
            if sock is not self.listener and sock is not self.wake_up:
                self._receive(sock, received)
        if self.wake_up in ready:
            self.wake_up.recv(64)
        if self.listener in ready:
            self._accept()
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
        if not self._room_for_one_more(sock):
            self.owners.pop(sock, None)
            sock.close()  # a rank turned away here tries again (Reporter)
            return
        peer = auth.ServerPeer(self.key, self.size)
        try:
            sock.settimeout(1.0)  # sends are small: a peer that reads nothing costs 1 s at most
            sock.sendall(peer.greeting)
            self.selector.register(sock, selectors.EVENT_READ)
        except (OSError, ValueError):
            self.owners.pop(sock, None)
            sock.close()
            return
        self.peers[sock] = peer

    def _room_for_one_more(self, newcomer: socket.socket) -> bool:
        """Whether a new connection may wait for its hello; when the set is full, another local
        user's newcomer is turned away, this user's evicts a waiting connection of another
        local user (it cannot hold the job key), else the oldest waiting one that had its
        grace period to answer is evicted."""
        pending = [(peer.opened, sock) for sock, peer in self.peers.items() if peer.rank is None]
        if len(pending) < self.MAX_PENDING:
            return True
        owner = self._owner(newcomer)  # read only under pressure: it scans /proc
        if owner is not None and owner != os.geteuid():
            return False
        if owner is not None:  # a rank of this host: first in the queue, before strangers
            foreign = [sock for _, sock in pending if self._owner(sock) not in (None, owner)]
            if foreign:
                self._drop(foreign[-1])
                return True
        opened, oldest = min(pending, key=lambda entry: entry[0])
        if time.monotonic() - opened < self.ANSWER_GRACE_S:
            return False  # every waiting one is new: the newcomer goes, not one of them
        self._drop(oldest)
        return True

    def _owner(self, sock: socket.socket) -> Optional[int]:
        """The local user at the other end of `sock` (None: another host), looked up once."""
        if sock not in self.owners:
            self.owners[sock] = auth.local_peer_uid(sock)
        return self.owners[sock]

    def _receive(self, sock: socket.socket, received: Dict[int, Position]) -> None:
        peer = self.peers.get(sock)
        if peer is None:  # closed earlier in this pass (poll reads before it evicts)
            return
        try:
            reply, positions = peer.feed(sock.recv(65536))
            if reply:
                sock.sendall(reply)
        except (OSError, auth.Rejected):
            self._drop(sock)
            return
        if peer.rank is not None:
            self.connections[peer.rank] = sock
            self.joined.add(peer.rank)
            if positions:
                received[peer.rank] = positions[-1]

    def _drop(self, sock: socket.socket) -> None:
        self.owners.pop(sock, None)
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
    """A non-zero rank's side: connects to rank 0, sends its position when it changed, answers
    stack requests.

    A connection that fails before it is authenticated (rank 0 not reachable yet, or turned
    away while others flood its port) is tried again, every :data:`RETRY_S` seconds at most,
    until :meth:`stop`: nobody outside the job can switch a rank's inspector off by keeping
    rank 0's listener busy at start-up. Once authenticated, rank 0 closing the connection
    means the job is ending, and the thread ends.

    Args:
        rank: this rank.
        connect: opens this rank's authenticated channel to rank 0
            (:func:`mgpu_launch.runtime.auth.connect`); raises OSError or auth.Rejected.
        position: returns this rank's current position.
        interval: seconds between two looks at the position.
        on_request: called (no arguments) after the stacks are printed, e.g. to dump this
            rank's timeline.
    """

    #: the longest wait between two attempts to reach rank 0
    RETRY_S = 2.0

    def __init__(self, rank: int, connect: Callable[[], auth.ClientChannel],
                 position: Callable[[], Position], interval: float = 0.5,
                 on_request: Optional[Callable[[], Any]] = None):
        super().__init__(name="mgpu-stall-reporter", daemon=True)
        self.rank, self.connect, self.position = rank, connect, position
        self.on_request = on_request
        self.interval, self.stopped = interval, threading.Event()
        self.channel: Optional[auth.ClientChannel] = None

    def run(self) -> None:
        self.channel = self._reach_rank_0()
        if self.channel is not None:
            self._report(self.channel)

    def _reach_rank_0(self) -> Optional[auth.ClientChannel]:
        wait, warned = 0.05, False
        while not self.stopped.is_set():
            try:
                return self.connect()
            except (OSError, auth.Rejected) as error:
                if not warned:
                    print(f"mgpu: warning: the stall inspector of rank {self.rank} cannot reach "
                          f"rank 0 yet ({error}); it keeps trying in the background.",
                          file=sys.stderr, flush=True)
                    warned = True
            self.stopped.wait(wait)
            wait = min(2 * wait, self.RETRY_S)
        return None

    def _report(self, channel: auth.ClientChannel) -> None:
        sent = None
        sock = channel.sock
        selector = selectors.DefaultSelector()
        try:
            selector.register(sock, selectors.EVENT_READ)
            while not self.stopped.is_set():
                where = self.position()
                if where != sent:
                    step, phase, detail = where
                    channel.send({"rank": self.rank,
                                  "position": [step, phase, detail[:auth.MAX_DETAIL]]})
                    sent = where
                if selector.select(self.interval):
                    data = sock.recv(4096)
                    if not data:
                        return  # rank 0 went away: the job is ending
                    for _ in channel.receive(data):  # "stacks", the only request
                        print(f"mgpu: stall: rank {self.rank}'s Python stacks (asked by rank 0):",
                              file=sys.stderr, flush=True)
                        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                        if self.on_request is not None:
                            self.on_request()
        except (OSError, ValueError):  # ValueError: auth.Rejected, or the socket was closed
            return
        finally:
            selector.close()
            sock.close()

    def stop(self) -> None:
        self.stopped.set()
        channel = self.channel
        if channel is not None:
            try:
                channel.sock.shutdown(socket.SHUT_RDWR)  # wakes run(), which closes it
            except OSError:
                pass
        if self.is_alive() and self is not threading.current_thread():
            self.join(2 * self.interval)
