"""The rendezvous's wire: framed JSON messages, a handshake that checks the rendezvous id and,
with a shared secret, authenticates both ends, and a MAC on every later message.

A frame is a 4-byte big-endian length and that many bytes.  The handshake's three frames are
plain JSON; every later frame is a 32-byte HMAC-SHA256 followed by the JSON body, the MAC
taken over the direction, a per-direction sequence number and the body, with a key derived
from the secret and both ends' nonces.  A peer that cannot compute it (no secret, another
secret, a replayed or reordered frame, bytes injected into the connection) is cut off.

The secret is ``MPITRAIN_RDZV_SECRET`` when it is set, the same on every node.  Without it the
handshake runs the same way with an empty key: it still separates rendezvous ids and catches
corrupted frames, but anyone who can reach the endpoint can compute it (see
docs/guide/rendezvous.md, "Security").
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
from collections.abc import Mapping
from typing import Any

PROTOCOL = 1
SECRET_VARIABLE = "MPITRAIN_RDZV_SECRET"
# Messages are small (a node list, a daemon's command line); a larger length is garbage or an
# attack, and must not make us allocate it.
MAX_FRAME = 1 << 20
HANDSHAKE_TIMEOUT_S = 10.0
_LENGTH = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_MAC_BYTES = 32


class WireError(ConnectionError):
    """The connection ended, or the peer sent something that is not our protocol."""


class Refused(Exception):
    """The other end turned this agent away; the message says why (a different rendezvous id,
    a different secret, a node that already joined, ...)."""


def secret_from(environ: Mapping[str, str]) -> bytes:
    """The shared secret from ``environ`` (empty when unset)."""
    return environ.get(SECRET_VARIABLE, "").encode()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = []
    while count:
        try:
            chunk = sock.recv(min(count, 65536))
        except TimeoutError:
            raise
        except OSError as exc:
            raise WireError(f"connection broken: {exc}") from None
        if not chunk:
            raise WireError("connection closed by the other end")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> bytes:
    (length,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if length > MAX_FRAME:
        raise WireError(f"a frame of {length} bytes: not the rendezvous protocol")
    return _recv_exact(sock, length)


def _json(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("a frame that is not JSON: not the rendezvous protocol") from None
    if not isinstance(message, dict):
        raise WireError("a frame that is not a JSON object: not the rendezvous protocol")
    return message


def _encode(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def send_json(sock: socket.socket, message: Mapping[str, Any]) -> None:
    """Send one unauthenticated frame (for a local Unix socket, where the file's permissions
    are the authentication)."""
    _send_frame(sock, _encode(message))


def recv_json(sock: socket.socket) -> dict[str, Any]:
    """Receive one unauthenticated frame.

    Raises:
        WireError: the connection ended or the frame is not a JSON object.
    """
    return _json(_recv_frame(sock))


class Channel:
    """An authenticated, framed connection.  ``send`` may be called from any thread; one
    thread calls ``recv``."""

    def __init__(self, sock: socket.socket, key: bytes, is_client: bool) -> None:
        self.sock = sock
        self._key = key
        self._out_tag, self._in_tag = (b"c", b"s") if is_client else (b"s", b"c")
        self._out_seq = self._in_seq = 0
        self._lock = threading.Lock()
        self.closed = False

    def set_send_timeout(self, seconds: float) -> None:
        """Let a send fail after ``seconds`` instead of blocking for ever when the other end
        stopped reading (a frozen machine fills our socket buffer; the heartbeat thread
        must not hang on it)."""
        whole = int(seconds)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                             struct.pack("ll", whole, int((seconds - whole) * 1e6)))

    def send(self, message: Mapping[str, Any]) -> None:
        """Send one message.

        Raises:
            WireError: the connection is gone.
        """
        body = _encode(message)
        with self._lock:
            if self.closed:
                raise WireError("connection already closed")
            mac = _mac(self._key, self._out_tag, _SEQ.pack(self._out_seq), body)
            self._out_seq += 1
            try:
                _send_frame(self.sock, mac + body)
            except OSError as exc:
                raise WireError(f"connection broken: {exc}") from None

    def recv(self) -> dict[str, Any]:
        """The next message (blocks).

        Raises:
            WireError: the connection ended, or a frame's MAC is wrong.
        """
        frame = _recv_frame(self.sock)
        mac, body = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
        expected = _mac(self._key, self._in_tag, _SEQ.pack(self._in_seq), body)
        if not hmac.compare_digest(mac, expected):
            raise WireError("a message failed its authentication check (forged, replayed or "
                            "corrupted)")
        self._in_seq += 1
        return _json(body)

    def close(self) -> None:
        """Close the connection; a thread blocked in ``recv`` gets a WireError."""
        with self._lock:
            self.closed = True
        with contextlib.suppress(OSError):  # already gone
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def client_handshake(sock: socket.socket, rdzv_id: str, secret: bytes,
                     hello: Mapping[str, Any], where: str) -> Channel:
    """Introduce this agent (``hello``) to the server at ``where`` and authenticate both ends.

    Raises:
        Refused: the server serves another rendezvous id or refused the secret; or the server
            could not prove that it knows this node's secret.
        WireError: the connection broke or the other end does not speak the protocol.
    """
    nonce = secrets.token_hex(16)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        _send_frame(sock, _encode({**hello, "protocol": PROTOCOL, "rdzv_id": rdzv_id,
                                   "nonce": nonce}))
        answer = _json(_recv_frame(sock))
        if "refused" in answer:
            raise Refused(str(answer["refused"]))
        server_nonce = str(answer.get("nonce", ""))
        proof = bytes.fromhex(str(answer.get("proof", "")))
        expected = _mac(secret, b"server", rdzv_id.encode(), nonce.encode(),
                        server_nonce.encode())
        if not server_nonce or not hmac.compare_digest(proof, expected):
            raise Refused(f"the rendezvous server at {where} could not prove that it knows "
                          f"this node's {SECRET_VARIABLE} (set here: "
                          f"{'yes' if secret else 'no'}); give every node the same secret")
        _send_frame(sock, _encode({"proof": _mac(secret, b"agent", rdzv_id.encode(),
                                                 nonce.encode(),
                                                 server_nonce.encode()).hex()}))
        verdict = _json(_recv_frame(sock))
        if "refused" in verdict:
            raise Refused(str(verdict["refused"]))
    except TimeoutError:
        raise WireError(f"no answer from {where} within {HANDSHAKE_TIMEOUT_S:g} s") from None
    except ValueError:  # bytes.fromhex on garbage
        raise WireError(f"{where} does not speak the rendezvous protocol") from None
    except WireError:
        raise
    except OSError as exc:
        raise WireError(f"connection to {where} broken: {exc}") from None
    sock.settimeout(None)
    key = _mac(secret, b"key", rdzv_id.encode(), nonce.encode(), server_nonce.encode())
    return Channel(sock, key, is_client=True)


def refuse(sock: socket.socket, reason: str) -> None:
    """Tell a connecting agent why it is turned away (before or during the handshake)."""
    with contextlib.suppress(OSError):  # it went away already; nothing it could act on
        _send_frame(sock, _encode({"refused": reason}))


def server_handshake(sock: socket.socket, rdzv_id: str, secret: bytes
                     ) -> tuple[Channel, dict[str, Any]]:
    """Authenticate an agent that connected; return its channel and its hello.

    Raises:
        Refused: another rendezvous id, another protocol, or a wrong secret (the agent has
            been told why, the socket is still open for the caller to close).
        WireError: the connection broke, timed out, or is not the protocol.
    """
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = _json(_recv_frame(sock))
        theirs = hello.get("rdzv_id")
        if hello.get("protocol") != PROTOCOL:
            reason = (f"rendezvous protocol {hello.get('protocol')!r} is not this server's "
                      f"{PROTOCOL}: use the same mpitrain version on every node")
            refuse(sock, reason)
            raise Refused(reason)
        if theirs != rdzv_id:
            reason = (f"this endpoint serves rendezvous id {rdzv_id!r}, not {theirs!r}: "
                      "another job is using it; give each job its own --rdzv-endpoint port or "
                      "the same --rdzv-id on all of its nodes")
            refuse(sock, reason)
            raise Refused(reason)
        their_nonce = str(hello.get("nonce", ""))
        nonce = secrets.token_hex(16)
        _send_frame(sock, _encode({"nonce": nonce, "proof": _mac(
            secret, b"server", rdzv_id.encode(), their_nonce.encode(), nonce.encode()).hex()}))
        answer = _json(_recv_frame(sock))
        proof = bytes.fromhex(str(answer.get("proof", "")))
        expected = _mac(secret, b"agent", rdzv_id.encode(), their_nonce.encode(),
                        nonce.encode())
        if not hmac.compare_digest(proof, expected):
            reason = (f"this node's {SECRET_VARIABLE} does not match the rendezvous server's; "
                      "give every node the same secret")
            refuse(sock, reason)
            raise Refused(reason)
        _send_frame(sock, _encode({"ok": True}))
    except TimeoutError:
        raise WireError(f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s") from None
    except ValueError:
        raise WireError("not the rendezvous protocol") from None
    except OSError as exc:
        if isinstance(exc, WireError):
            raise
        raise WireError(f"connection broken: {exc}") from None
    sock.settimeout(None)
    key = _mac(secret, b"key", rdzv_id.encode(), their_nonce.encode(), nonce.encode())
    return Channel(sock, key, is_client=False), hello


__all__ = ["HANDSHAKE_TIMEOUT_S", "MAX_FRAME", "PROTOCOL", "SECRET_VARIABLE", "Channel",
           "Refused", "WireError", "client_handshake", "recv_json", "refuse", "secret_from",
           "send_json", "server_handshake"]
