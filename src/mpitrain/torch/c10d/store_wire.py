"""The job's store on the wire: its frames, its operations, and the handshake both ways.

Separate from :mod:`.store` (the server and the ``torch.distributed.Store`` client) because it
is the protocol both ends share, and the one place that says what a connection must prove
before anything else travels on it:

* the server sends a random challenge; the client answers with its HMAC-SHA256 under the job's
  key (a wrong answer closes the connection), then sends a challenge of its own, which the
  server answers in turn, so a client never hands its data to an impostor;
* after that, every request is a frame: one byte (the operation), a field count, then each
  field with its length; a reply is a frame of the same shape (one byte: OK, TIMEOUT or BAD).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
from collections.abc import Sequence

_NONCE = 32
_CLIENT, _SERVER = b"mpitrain-store-client", b"mpitrain-store-server"
HANDSHAKE_S = 10.0  # how long a connection may take to prove itself

# Requests: one byte, then length-prefixed fields.
SET, GET, ADD, CAS, CHECK, WAIT, NUM, DELETE, APPEND, MGET, MSET, LIST = range(1, 13)
# Replies: one byte, then fields.
OK, TIMEOUT, BAD = 0, 1, 2


class AuthenticationError(ConnectionError):
    """The other end of a store connection did not prove it knows the job's key."""


def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


# ---------------------------------------------------------------- framing
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the store connection was closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, head: int, fields: Sequence[bytes]) -> None:
    parts = [struct.pack("!BI", head, len(fields))]
    for f in fields:
        parts.append(struct.pack("!Q", len(f)))
        parts.append(f)
    sock.sendall(b"".join(parts))


def recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    head, count = struct.unpack("!BI", _recv_exact(sock, 5))
    fields = []
    for _ in range(count):
        (length,) = struct.unpack("!Q", _recv_exact(sock, 8))
        fields.append(_recv_exact(sock, length))
    return head, fields


# ---------------------------------------------------------------- handshake
def accept(conn: socket.socket, key: bytes) -> bool:
    """The server's half of the handshake on a new connection: whether it proved ``key``
    (answering the client's challenge in turn when it did)."""
    challenge = secrets.token_bytes(_NONCE)
    conn.sendall(challenge)
    answer = _recv_exact(conn, 32)
    if not hmac.compare_digest(answer, _mac(key, _CLIENT, challenge)):
        return False
    theirs = _recv_exact(conn, _NONCE)
    conn.sendall(_mac(key, _SERVER, theirs))
    return True


def connect(address: str, port: int, key: bytes, timeout_s: float) -> socket.socket:
    """A connection to the store at ``address:port`` that has proved itself both ways.

    Raises:
        AuthenticationError: the server did not prove it knows ``key``.
        OSError: no connection within ``timeout_s``.
    """
    sock = socket.create_connection((address, port), timeout=min(timeout_s, HANDSHAKE_S))
    try:
        challenge = _recv_exact(sock, _NONCE)
        sock.sendall(_mac(key, _CLIENT, challenge))
        mine = secrets.token_bytes(_NONCE)
        sock.sendall(mine)
        try:
            proof = _recv_exact(sock, 32)
        except OSError:  # the server hung up on our answer: it holds another key
            raise AuthenticationError(f"the store at {address}:{port} refused this process: "
                                      "it is not the job's key") from None
        if not hmac.compare_digest(proof, _mac(key, _SERVER, mine)):
            raise AuthenticationError(f"the store at {address}:{port} did not prove it knows "
                                      "the job's key")
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


__all__ = ["ADD", "APPEND", "BAD", "CAS", "CHECK", "DELETE", "GET", "HANDSHAKE_S", "LIST", "MGET",
           "MSET", "NUM", "OK", "SET", "TIMEOUT", "WAIT", "AuthenticationError", "accept",
           "connect", "recv_frame", "send_frame"]
