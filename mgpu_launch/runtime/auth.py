"""The job's trust boundary: its secret, and the one gate everything read from outside passes.

Whatever mgpu reads from a socket or a folder another process could write goes through a
function of this module before any other code sees it (as Horovod's service messages carry an
HMAC of a per-job key); code past this point trusts what it gets and does not check again.

* **The job key.** Rank 0 makes 32 random bytes at ``mgpu.init()`` and MPI, the bootstrap every
  rank joined through, shares them (:func:`share_job_key`). Nobody outside the job has it.
* **Control connections** (the stall inspector's side channel). The listening side greets a new
  connection with a fresh nonce; the connecting rank answers with its rank, its own nonce and
  an HMAC-SHA256 of both under the job key; the listener answers with its own HMAC, so each
  side knows the other holds the key. After that every line carries an HMAC under a key of that
  connection alone and a sequence number, so a line cannot be forged, replayed or reordered.
  A connection that fails a check, sends a line over :data:`MAX_LINE` bytes, a message that is
  not of its schema, or no valid hello within :data:`HELLO_TIMEOUT_S`, raises
  :class:`Rejected`: the caller closes that connection, and nothing else changes.
* **Signed files** (``mgpu_launch.run``'s pickles): :func:`sign` / :func:`verify`, with a key of
  the call. A file whose HMAC does not match is an error, never unpickled.
* **Folders** mgpu reads back from or writes into (``run()``'s work folder, backups, the
  elastic state) pass :func:`mgpu_launch.runtime.folders.private_folder` first: owned by this
  user, nobody else may write in them or redirect their path.

What it does not give: secrecy (the lines are readable on the wire) or protection from someone
who can read the ranks' memory or environment (the job's own user, root). See docs/security.md.
"""

import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
from typing import Any, Dict, List, Optional, Tuple

KEY_BYTES = 32
#: the longest line a control connection may send, newline excluded
MAX_LINE = 1024
#: seconds a new connection has to prove the key
HELLO_TIMEOUT_S = 5.0
#: the longest position detail a rank may send (e.g. "epoch 2")
MAX_DETAIL = 200

_CHALLENGE, _HELLO, _WELCOME = b"mgpu-challenge", b"mgpu-hello", b"mgpu-welcome"
_TO_SERVER, _TO_CLIENT = b"to-rank-0", b"from-rank-0"

Position = Tuple[int, int, str]


class Rejected(ValueError):
    """A peer failed to prove the job key, or sent something malformed: close its connection."""


def new_key() -> bytes:
    """A fresh random key (32 bytes)."""
    return secrets.token_bytes(KEY_BYTES)


def share_job_key(transport) -> bytes:
    """Collective: rank 0's fresh job key, on every rank of `transport` (the control plane,
    mgpu_launch.runtime.transport: every rank joined it through its starter, before any socket
    of ours is open)."""
    return transport.broadcast_object(new_key() if transport.rank == 0 else None, 0)


def _mac(key: bytes, *parts: bytes) -> bytes:
    # Length-prefixed, so no two different part lists give the same input.
    message = b"".join(len(part).to_bytes(4, "big") + part for part in parts)
    return hmac.new(key, message, hashlib.sha256).digest()


# --- signed files --------------------------------------------------------------------------

def sign(key: bytes, label: str, data: bytes) -> bytes:
    """`data` with an HMAC of it and of `label` (what the file is, e.g. ``result 1``) in front."""
    return _mac(key, label.encode(), data) + data


def verify(key: bytes, label: str, blob: bytes) -> bytes:
    """The data of a :func:`sign` blob.

    Raises:
        Rejected: its HMAC does not match `key` and `label` (changed, or another call's file).
    """
    mac, data = blob[:hashlib.sha256().digest_size], blob[hashlib.sha256().digest_size:]
    if not hmac.compare_digest(mac, _mac(key, label.encode(), data)):
        raise Rejected(f"the {label} does not carry this call's signature: it was written or "
                       f"changed by someone else")
    return data


# --- control connections -------------------------------------------------------------------

class _Lines:
    """Splits a byte stream into lines no longer than MAX_LINE."""

    def __init__(self):
        self.buffer = b""

    def feed(self, data: bytes) -> List[bytes]:
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        if len(self.buffer) > MAX_LINE or any(len(line) > MAX_LINE for line in lines):
            raise Rejected(f"a line longer than {MAX_LINE} bytes")
        return lines


def _unsplit(lines: List[bytes], partial: bytes) -> bytes:
    """The bytes that :meth:`_Lines.feed` split into `lines` and left `partial`."""
    return b"".join(line + b"\n" for line in lines) + partial


def _hex(line: bytes, size: int) -> bytes:
    try:
        value = bytes.fromhex(line.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise Rejected("not hexadecimal") from None
    if len(value) != size:
        raise Rejected("a nonce or HMAC of the wrong size")
    return value


def _int(value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise Rejected(f"{value!r} is not a whole number in [{low}, {high})")
    return value


class _Session:
    """Sealing and opening lines of an authenticated connection (one key, two counters)."""

    def __init__(self, key: bytes, server_nonce: bytes, client_nonce: bytes, rank: int,
                 outgoing: bytes, incoming: bytes):
        self.key = _mac(key, b"session", server_nonce, client_nonce, str(rank).encode())
        self.outgoing, self.incoming = outgoing, incoming
        self.sent = self.received = 0
        self.lines = _Lines()

    def seal(self, message: Dict[str, Any]) -> bytes:
        body = json.dumps(message, separators=(",", ":")).encode()
        mac = _mac(self.key, self.outgoing, str(self.sent).encode(), body)
        self.sent += 1
        return mac.hex().encode() + b" " + body + b"\n"

    def open(self, data: bytes) -> List[Dict[str, Any]]:
        messages = []
        for line in self.lines.feed(data):
            mac, _, body = line.partition(b" ")
            expected = _mac(self.key, self.incoming, str(self.received).encode(), body)
            if not hmac.compare_digest(_hex(mac, len(expected)), expected):
                raise Rejected("a line without this connection's HMAC")
            self.received += 1
            try:
                message = json.loads(body)
            except ValueError:
                raise Rejected("a line that is not JSON") from None
            if not isinstance(message, dict):
                raise Rejected("a message that is not a JSON object")
            messages.append(message)
        return messages


def _position(message: Dict[str, Any], rank: int) -> Position:
    """The position a rank's message reports, checked against the schema."""
    if set(message) != {"rank", "position"}:
        raise Rejected(f"a message with keys {sorted(message)}; expected rank, position")
    if _int(message["rank"], 0, 1 << 31) != rank:
        raise Rejected(f"rank {rank} sent a position for rank {message['rank']}")
    where = message["position"]
    if not isinstance(where, list) or len(where) != 3:
        raise Rejected("a position that is not [step, phase, detail]")
    step, phase, detail = where
    if not isinstance(detail, str) or len(detail) > MAX_DETAIL:
        raise Rejected("a position detail that is not a short string")
    return _int(step, 0, 1 << 62), _int(phase, 0, 64), detail


def local_peer_uid(sock: socket.socket) -> Optional[int]:
    """The user owning the other end of a TCP connection made from this host, else None.

    Linux only (``/proc/net/tcp`` and ``tcp6`` list every socket of this network namespace with
    its owner): a connection from another host, another namespace or another system gives None.
    The listener uses it to turn away another local user's connections when its queue of
    unauthenticated ones is full: they cannot hold the job key, and cannot crowd a rank out.
    """
    try:
        ours, theirs = sock.getsockname(), sock.getpeername()
        table = "/proc/net/tcp6" if sock.family == socket.AF_INET6 else "/proc/net/tcp"
        # In the table, the peer's socket has our peer address as its local one, and ours as
        # its remote one; addresses are printed as the kernel's 32-bit words, in hex.
        wanted = (_proc_address(sock.family, *theirs[:2]), _proc_address(sock.family, *ours[:2]))
        with open(table) as listing:
            next(listing)
            for line in listing:
                fields = line.split()
                if (fields[1], fields[2]) == wanted:
                    return int(fields[7])
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return None


def _proc_address(family: int, host: str, port: int) -> str:
    packed = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


class ServerPeer:
    """One accepted control connection, as the listener (rank 0) sees it.

    Send :attr:`greeting` first, then pass every chunk received to :meth:`feed`; after a
    valid hello, :attr:`rank` is the peer's authenticated rank.

    Args:
        key: the job key.
        size: the job's size (a hello must name a rank in ``1..size-1``).
    """

    def __init__(self, key: bytes, size: int):
        self.key, self.size = key, size
        self.nonce = secrets.token_bytes(16)
        self.opened = time.monotonic()
        self.deadline = self.opened + HELLO_TIMEOUT_S
        self.rank: Optional[int] = None
        self.session: Optional[_Session] = None
        self.lines = _Lines()
        self.greeting = _CHALLENGE + b" " + self.nonce.hex().encode() + b"\n"

    def feed(self, data: bytes) -> Tuple[bytes, List[Position]]:
        """(bytes to send back, validated positions of the peer's rank) for received `data`.

        Raises:
            Rejected: the peer did not prove the key, or sent a malformed message.
        """
        if not data:
            raise Rejected("the connection was closed")
        if self.session is not None:
            return b"", [_position(m, self.rank) for m in self.session.open(data)]
        lines = self.lines.feed(data)
        if not lines:
            return b"", []
        parts = lines[0].split(b" ")
        if len(parts) != 4 or parts[0] != _HELLO:
            raise Rejected("no hello")
        try:
            rank = _int(int(parts[1]), 1, self.size)
        except ValueError:
            raise Rejected("a hello without a rank") from None
        client_nonce = _hex(parts[2], 16)
        expected = _mac(self.key, _HELLO, self.nonce, client_nonce, str(rank).encode())
        if not hmac.compare_digest(_hex(parts[3], len(expected)), expected):
            raise Rejected("a hello without the job key's HMAC")
        self.rank = rank
        self.session = _Session(self.key, self.nonce, client_nonce, rank, _TO_CLIENT, _TO_SERVER)
        welcome = _mac(self.key, _WELCOME, self.nonce, client_nonce, str(rank).encode())
        rest = _unsplit(lines[1:], self.lines.buffer)
        positions = [_position(m, rank) for m in self.session.open(rest)] if rest else []
        return _WELCOME + b" " + welcome.hex().encode() + b"\n", positions

    def seal(self, message: Dict[str, Any]) -> bytes:
        """A message to the authenticated peer, as a line."""
        return self.session.seal(message)


class ClientChannel:
    """A rank's authenticated connection to the listener; see :func:`connect`."""

    def __init__(self, sock: socket.socket, session: _Session):
        self.sock, self.session = sock, session

    def send(self, message: Dict[str, Any]) -> None:
        self.sock.sendall(self.session.seal(message))

    def receive(self, data: bytes) -> List[str]:
        """The requests in `data` received from the listener (e.g. ``["stacks"]``).

        Raises:
            Rejected: the listener sent something unsigned or malformed.
        """
        requests = []
        for message in self.session.open(data):
            if set(message) != {"request"} or message["request"] not in ("stacks",):
                raise Rejected(f"an unknown request {message!r}")
            requests.append(message["request"])
        return requests


def connect(host: str, port: int, key: bytes, rank: int, timeout: float) -> ClientChannel:
    """Connect to a control listener and prove the job key (both ways) within `timeout` s.

    Raises:
        OSError: the listener cannot be reached or went away.
        Rejected: the listener did not prove the job key.
    """
    deadline = time.monotonic() + timeout
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        lines, pending = _Lines(), []

        def read_line() -> bytes:
            while not pending:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = sock.recv(MAX_LINE)
                if not data:
                    raise ConnectionError("the listener closed the connection")
                pending.extend(lines.feed(data))
            return pending.pop(0)

        challenge, _, nonce = read_line().partition(b" ")
        if challenge != _CHALLENGE:
            raise Rejected("the listener sent no challenge")
        server_nonce, client_nonce = _hex(nonce, 16), secrets.token_bytes(16)
        rank_bytes = str(rank).encode()
        hello = _mac(key, _HELLO, server_nonce, client_nonce, rank_bytes)
        sock.sendall(b" ".join([_HELLO, rank_bytes, client_nonce.hex().encode(),
                                hello.hex().encode()]) + b"\n")
        word, _, welcome = read_line().partition(b" ")
        expected = _mac(key, _WELCOME, server_nonce, client_nonce, rank_bytes)
        if word != _WELCOME or not hmac.compare_digest(_hex(welcome, len(expected)), expected):
            raise Rejected("the listener did not prove the job key")
        sock.settimeout(None)
        session = _Session(key, server_nonce, client_nonce, rank, _TO_SERVER, _TO_CLIENT)
        session.lines.buffer = _unsplit(pending, lines.buffer)  # read with the next bytes
        return ClientChannel(sock, session)
    except BaseException:
        sock.close()
        raise
