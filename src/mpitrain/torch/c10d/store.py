"""The job's torch.distributed store: a key-value server that only the job's processes can use.

torch's ``TCPStore`` answers anyone who connects: served on ``0.0.0.0`` by rank 0, anyone
who could reach that node could read and write the job's rendezvous (Gloo's addresses, DDP's
barriers) while it ran.  So the env:// rendezvous under MPI (:mod:`.rendezvous`) serves this
store instead:

* **bound where the job talks**, never to a wildcard address: the loopback address, plus, when
  ranks run on other hosts, the address through which this host reaches them (the interface
  the kernel routes the job's traffic over); ports chosen by the kernel;
* **a connection proves it belongs to the job** before anything else: the server sends a
  random challenge and the client must answer with its HMAC-SHA256 under the job's key, 32
  random bytes that rank 0 drew and broadcast to the ranks over MPI, so it never crossed a
  socket of ours; a wrong answer closes the connection.  The server answers a challenge of the
  client's in turn, so a client never hands its data to an impostor.  Traffic after that is not
  encrypted (like MPI's own): the key keeps out whoever connects, not whoever can read the wire.

The frames and both halves of that handshake are :mod:`.store_wire`'s.

The client (:class:`JobStore`) is a ``torch.distributed.Store`` written in Python: torch and
Gloo call it like any store (``PrefixStore`` wraps it, ``new_group(backend="gloo")`` and DDP
rendezvous through it).  Each connection carries one request at a time; a call that finds every
connection of the process busy (a thread blocked in ``wait``) opens another.

The server is a thread per connection: rank 0 holds one connection per rank and thread (a few
per rank), which the rendezvous of a job needs, not a general-purpose store's scale.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .store_wire import (
    ADD,
    APPEND,
    BAD,
    CAS,
    CHECK,
    DELETE,
    GET,
    HANDSHAKE_S,
    LIST,
    MGET,
    MSET,
    NUM,
    OK,
    SET,
    TIMEOUT,
    WAIT,
    AuthenticationError,
    accept,
    connect,
    recv_frame,
    send_frame,
)

KEY_BYTES = 32


def new_key() -> bytes:
    """A fresh random key for one job's store."""
    return secrets.token_bytes(KEY_BYTES)


# ---------------------------------------------------------------- server
class StoreServer:
    """The key-value server: listens on ``addresses`` (one port for all), serves connections
    that prove the key, until :meth:`close`.

    Raises:
        ValueError: an address is a wildcard (``0.0.0.0``, ``::``, empty).
        OSError: no common free port could be bound.
    """

    def __init__(self, key: bytes, addresses: Sequence[str]) -> None:
        bad = [a for a in addresses if a in ("", "0.0.0.0", "::")]
        if bad or not addresses:
            raise ValueError(f"the job's store binds to given addresses only, not {addresses!r}")
        self.key = key
        self.addresses = list(dict.fromkeys(addresses))
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._conns: set[socket.socket] = set()
        self.refused = 0  # connections that failed the challenge (tests read it)
        self.listeners, self.port = self._listen()
        for listener in self.listeners:
            threading.Thread(target=self._accept, args=(listener,), daemon=True,
                             name="mpitrain-store-accept").start()

    def _listen(self) -> tuple[list[socket.socket], int]:
        for _attempt in range(20):
            listeners: list[socket.socket] = []
            port = 0
            try:
                for address in self.addresses:
                    family = socket.AF_INET6 if ":" in address else socket.AF_INET
                    sock = socket.socket(family, socket.SOCK_STREAM)
                    listeners.append(sock)
                    sock.bind((address, port))
                    port = sock.getsockname()[1]
                    sock.listen(128)
                return listeners, port
            except OSError:
                # The port the first address got is taken on another: draw again.
                for sock in listeners:
                    sock.close()
        raise OSError(f"no free port common to {self.addresses}")

    def close(self) -> None:
        """Stop serving: close the listeners and every connection."""
        self._closed = True
        for sock in [*self.listeners, *list(self._conns)]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self._changed:
            self._changed.notify_all()

    def _accept(self, listener: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="mpitrain-store-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(HANDSHAKE_S)
                try:
                    proved = accept(conn, self.key)
                except (OSError, ConnectionError):
                    proved = False  # gave up, or sent something else (torch's own client)
                if not proved:
                    self.refused += 1
                    return
                conn.settimeout(None)
                self._conns.add(conn)
                while not self._closed:
                    head, fields = recv_frame(conn)
                    reply, out = self._handle(head, fields)
                    send_frame(conn, reply, out)
            except (OSError, ConnectionError, struct.error):
                return  # the client went away (or was refused)
            finally:
                self._conns.discard(conn)

    # The operations, with torch's TCPStore meaning.
    def _handle(self, head: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        cond, data = self._changed, self._data
        if head == SET:
            with cond:
                data[f[0].decode()] = f[1]
                cond.notify_all()
            return OK, []
        if head == APPEND:
            with cond:
                key = f[0].decode()
                data[key] = data.get(key, b"") + f[1]
                cond.notify_all()
            return OK, []
        if head == MSET:
            with cond:
                for k, v in zip(f[0::2], f[1::2]):
                    data[k.decode()] = v
                cond.notify_all()
            return OK, []
        if head == ADD:
            with cond:
                key = f[0].decode()
                value = int(data.get(key, b"0")) + int(f[1])
                data[key] = str(value).encode()
                cond.notify_all()
            return OK, [str(value).encode()]
        if head == CAS:
            with cond:
                key, expected, desired = f[0].decode(), f[1], f[2]
                current = data.get(key)
                if (current is None and expected == b"") or current == expected:
                    data[key] = desired
                    cond.notify_all()
                    return OK, [desired]
                return OK, [expected if current is None else current]
        if head in (GET, WAIT, MGET):
            keys = [k.decode() for k in f[1:]]
            deadline = time.monotonic() + int(f[0]) / 1e3
            with cond:
                while not all(k in data for k in keys):
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed:
                        return TIMEOUT, [",".join(k for k in keys if k not in data).encode()]
                    cond.wait(left)
                return OK, [] if head == WAIT else [data[k] for k in keys]
        if head == CHECK:
            with cond:
                return OK, [b"1" if all(k.decode() in data for k in f) else b"0"]
        if head == NUM:
            with cond:
                return OK, [str(len(data)).encode()]
        if head == DELETE:
            with cond:
                return OK, [b"1" if data.pop(f[0].decode(), None) is not None else b"0"]
        if head == LIST:
            with cond:
                return OK, [k.encode() for k in data]
        return BAD, [f"unknown store operation {head}".encode()]


# ---------------------------------------------------------------- client
def _as_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (list, tuple)):  # torch passes a std::vector<uint8_t> as a list
        return bytes(value)
    raise TypeError(f"store values are bytes or str, not {type(value).__name__}")


# torch keeps a store it was handed as a C++ pointer; the Python half of a store written in
# Python (its methods) must outlive every such pointer, or torch's calls find no method
# ("Not implemented", seen with Gloo's rendezvous).  So every client stays here until closed.
_alive: set[JobStore] = set()


class JobStore(dist.Store):
    """A ``torch.distributed.Store`` on a :class:`StoreServer` (see the module)."""

    def __init__(self, address: str, port: int, key: bytes,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> None:
        super().__init__()
        self.address, self.port, self._key = address, port, key
        self.set_timeout(timeout)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._put(self._connect())  # fail here, at the rendezvous, if the store is unreachable
        _alive.add(self)

    def _timeout_s(self) -> float:
        return max(self.timeout.total_seconds(), 0.001)  # type: ignore[attr-defined]

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self._timeout_s()
        while True:
            try:
                return connect(self.address, self.port, self._key, self._timeout_s())
            except AuthenticationError:
                raise
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"cannot reach the job's store at {self.address}:"
                                              f"{self.port}: {exc}") from None
                time.sleep(0.05)

    def _put(self, sock: socket.socket) -> None:
        with self._lock:
            self._idle.append(sock)

    def _call(self, head: int, fields: Sequence[bytes],
              waited_s: float | None = None) -> list[bytes]:
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        if sock is None:  # every connection is busy (a wait in another thread): one more
            sock = self._connect()
        try:
            send_frame(sock, head, fields)
            reply, out = recv_frame(sock)
        except BaseException:
            sock.close()
            raise
        self._put(sock)
        if reply == TIMEOUT:
            missing = out[0].decode() if out else "?"
            seconds = self._timeout_s() if waited_s is None else waited_s
            raise dist.DistStoreError(f"timed out after {seconds:g} s waiting for key(s) "
                                      f"{missing} in the job's store")
        if reply != OK:
            raise RuntimeError(out[0].decode() if out else "the job's store refused a request")
        return out

    def _ms(self, timeout: datetime.timedelta | None = None) -> bytes:
        seconds = self._timeout_s() if timeout is None else timeout.total_seconds()
        return str(int(seconds * 1e3)).encode()

    # torch.distributed.Store's interface.
    def set(self, key: str, value: Any) -> None:
        self._call(SET, [key.encode(), _as_bytes(value)])

    def get(self, key: str) -> bytes:
        return self._call(GET, [self._ms(), key.encode()])[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(ADD, [key.encode(), str(int(amount)).encode()])[0])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(CAS, [key.encode(), _as_bytes(expected), _as_bytes(desired)])[0]

    def append(self, key: str, value: Any) -> None:
        self._call(APPEND, [key.encode(), _as_bytes(value)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(MGET, [self._ms(), *(k.encode() for k in keys)])

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        fields = []
        for k, v in zip(keys, values):
            fields += [k.encode(), _as_bytes(v)]
        self._call(MSET, fields)

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [k.encode() for k in keys])[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call(WAIT, [self._ms(timeout), *(k.encode() for k in keys)],
                   None if timeout is None else timeout.total_seconds())

    def num_keys(self) -> int:
        return int(self._call(NUM, [])[0])

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [key.encode()])[0] == b"1"

    # The names torch's C++ side looks up for these two (a PrefixStore over this one, say).
    getNumKeys = num_keys  # noqa: N815
    deleteKey = delete_key  # noqa: N815

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call(LIST, [])]

    def clone(self) -> JobStore:
        return JobStore(self.address, self.port, self._key, self.timeout)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Close this client's connections; torch must no longer hold it."""
        _alive.discard(self)
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def close_clients() -> None:
    """Close every client of this process (their server is going away)."""
    for client in list(_alive):
        client.close()


__all__ = ["AuthenticationError", "JobStore", "StoreServer", "close_clients", "connect", "new_key"]
