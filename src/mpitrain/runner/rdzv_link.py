"""A live rendezvous connection: a reader thread, heartbeats both ways, and the silence that
counts as the other end's death.

A peer whose process dies closes its connection and we learn it at once.  A peer whose
machine loses power or network closes nothing; only its silence tells.  So each end sends a
heartbeat every second and gives the other up after ``timeout`` seconds without a word:
that is the bound within which a vanished node is noticed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .rdzv_wire import Channel, WireError

HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0


class Link:
    """One authenticated connection kept alive.

    Args:
        channel: the connection after its handshake.
        on_message: called (in the reader thread) with every message but heartbeats.
        on_end: called once, with the reason, when the link ends for any cause: the other end
            closed, a broken or forged frame, its silence, or :meth:`close`.
        timeout_s: silence after which the other end is given up.
    """

    def __init__(self, channel: Channel, on_message: Callable[[dict[str, Any]], None],
                 on_end: Callable[[str], None],
                 timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
        self.channel = channel
        self.on_message = on_message
        self.on_end = on_end
        self.timeout_s = timeout_s
        self.last_heard = time.monotonic()
        self._ended = threading.Event()
        self._end_lock = threading.Lock()
        self.reason: str | None = None
        channel.set_send_timeout(timeout_s)

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    def start(self) -> Link:
        threading.Thread(target=self._read, name="rdzv-read", daemon=True).start()
        threading.Thread(target=self._beat, name="rdzv-beat", daemon=True).start()
        return self

    def send(self, message: Mapping[str, Any]) -> bool:
        """Send ``message``; False when the link is gone (it has then ended)."""
        if self.ended:
            return False
        try:
            self.channel.send(message)
            return True
        except WireError as exc:
            self.end(str(exc))
            return False

    def end(self, reason: str) -> None:
        """End the link (once): close the connection, then tell the owner why."""
        with self._end_lock:
            if self._ended.is_set():
                return
            self.reason = reason
            self._ended.set()
        self.channel.close()
        self.on_end(reason)

    def close(self) -> None:
        self.end("closed by this end")

    def wait_ended(self, timeout_s: float) -> bool:
        return self._ended.wait(timeout_s)

    def _read(self) -> None:
        while not self.ended:
            try:
                message = self.channel.recv()
            except WireError as exc:
                self.end(str(exc))
                return
            self.last_heard = time.monotonic()
            if message.get("t") != "hb":
                try:
                    self.on_message(message)
                except Exception as exc:  # a bug or a malformed message: never a silent hang
                    self.end(f"cannot handle message {message.get('t')!r}: "
                             f"{type(exc).__name__}: {exc}")
                    return

    def _beat(self) -> None:
        while not self._ended.wait(HEARTBEAT_INTERVAL_S):
            silent = time.monotonic() - self.last_heard
            if silent > self.timeout_s:
                self.end(f"no heartbeat for {silent:.0f} s (its machine or network may be "
                         f"down; the limit is {self.timeout_s:g} s)")
                return
            self.send({"t": "hb"})


__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT_S", "HEARTBEAT_INTERVAL_S", "Link"]
