"""Waiting for a non-blocking MPI request without spinning the CPU.

Separate from :mod:`.negotiation`, which waits this way for its header every round, because the
engine's other collectives (the name counters agreed after a join) wait the same way: a rank
that waits must give its core to the rank everyone is waiting for when there are more ranks
than cores, whoever is waiting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any


def wait_for(request: Any, on_slow: Callable[[float], None] | None = None,
             slow_after: float = 0.0) -> None:
    """Complete a non-blocking MPI request without spinning the CPU.

    A few yields first (the common case: the others are a few microseconds behind), then
    sleeps growing to 1 ms, so that with more ranks than cores the waiting rank gives its core
    to the rank everyone is waiting for.
    """
    if request.Test():
        return
    start = time.monotonic()
    next_report = start + slow_after if on_slow is not None and slow_after > 0 else None
    polls = 0
    while not request.Test():
        polls += 1
        if polls < 64:
            os.sched_yield()
        else:
            time.sleep(min(1e-3, 2e-5 * (polls - 63)))
        if next_report is not None and time.monotonic() >= next_report:
            assert on_slow is not None
            on_slow(time.monotonic() - start)
            next_report += slow_after


__all__ = ["wait_for"]
