"""SIGINT and SIGTERM handed to the launcher's own handler while a job or an agent runs.

``mpitrainrun`` is a parent: Ctrl-C or a scheduler's SIGTERM must reach the job it started
(``mpirun`` then ends every rank cleanly) or the rendezvous agent that waits for it, instead
of killing the parent and orphaning the ranks.  Both signals get the same handler for the
block's duration; the previous handlers come back after it, whatever way it ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def on_signals(handler: Callable[[int], None]) -> Iterator[None]:
    """Call ``handler(signum)`` on SIGINT and SIGTERM inside the block (main thread only)."""
    def call(signum: int, _frame: Any) -> None:
        handler(signum)

    previous = {s: signal.signal(s, call) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def forwarding_signals(proc: Any) -> Iterator[None]:
    """Pass SIGINT/SIGTERM on to the launched job while it runs (so Ctrl-C reaches every
    rank through mpirun, which then ends the job cleanly)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    with on_signals(proc.send_signal):
        yield
