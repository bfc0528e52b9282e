"""Which thread runs the engine's cycles, and when.

A cycle (``Engine.run_cycle``) is one negotiation round per process set and the execution of
what it decided.  Cycles run one at a time, under one lock, on whichever thread holds it:

* the engine thread, woken by a submission or by its timer (``CycleDriver._sleep``);
* a thread that waits on a handle (``synchronize``) while no cycle is running: it runs the
  cycles itself until its request is done.  A synchronous call then costs no hand-over from
  the caller to the engine thread and back (two wake-ups and two passes of the GIL between
  threads, most of a small synchronous allreduce's cost on busy cores), while the engine
  thread still carries asynchronous work (a backward pass's buckets) on its own.

Rounds pair up across ranks in order whoever runs them, so ranks may mix the two freely.  CUDA
work stays on the engine thread (its streams and current device): a job that ever submitted a
CUDA request runs every cycle there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_IDLE_MAX_S = 0.05  # the longest an idle engine thread sleeps between rounds
_BURST_GAP_S = 5e-5  # a submission gap this long ends a burst


class CycleDriver:
    """The cycle lock and the two ways of taking it (the engine thread's loop, a waiter)."""

    def __init__(self, run_cycle: Callable[[], bool], cond: threading.Condition,
                 queued: Callable[[], int], stopping: Callable[[], bool],
                 cycle_time_s: Callable[[], float]) -> None:
        """``run_cycle()`` runs one cycle and returns False once the engine has ended (stopped
        or failed); ``cond`` is the condition the engine notifies on a submission or a stop;
        ``queued()`` counts the submissions waiting for a cycle, ``stopping()`` says whether a
        stop was asked for, ``cycle_time_s()`` is the cycle time."""
        self._run_cycle = run_cycle
        self._cond = cond
        self._queued = queued
        self._stopping = stopping
        self._cycle_time_s = cycle_time_s
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.ended = False
        # Rounds may decide something (requests pending here after the last cycle, or some
        # rank's smaller set needs this rank's global rounds): the engine thread then runs
        # rounds at the cycle time, unless a waiter of this rank is running them: then it
        # stays asleep, since every wake-up takes the GIL from the waiter.
        self.someone_pending = False
        self.waiter_running = False
        self.cycles = 0
        self.inline_cycles = 0  # of them, run by a waiting thread
        self.inline_allowed = True  # False once a CUDA request was submitted

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="mpitrain-engine", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        """The engine thread: sleep, then run a cycle unless a waiter ran them meanwhile."""
        idle = self._cycle_time_s()
        while True:
            seen = self.cycles
            self._sleep(self.someone_pending, idle)
            if self.waiter_running and not self._queued() and not self._stopping():
                continue  # a waiter of this rank runs the rounds (see someone_pending)
            with self._lock:
                if self.ended:
                    return
                if self.cycles != seen and not self._queued() and not self._stopping():
                    # A waiting thread ran the cycles this wake-up was for; a round of ours
                    # now would only make the other ranks wait to pair with it.
                    continue
                idle = self._cycle_time_s() if self.someone_pending \
                    else min(_IDLE_MAX_S, max(idle * 2, 1e-3))
                if not self._cycle():
                    return

    def wake(self) -> None:
        """End the engine thread's sleep."""
        with self._cond:
            self._cond.notify()

    def _sleep(self, busy: bool, idle: float) -> None:
        """Wait for work; then, while a burst of submissions continues, keep collecting.

        A burst (1,000 gradients in a backward pass) is gathered for up to the cycle time so it
        travels in a few fused buckets; a lone submission goes out after one short gap.
        """
        cycle = self._cycle_time_s()
        with self._cond:
            if not self._queued() and not self._stopping():
                self._cond.wait(cycle if busy else idle)
            # A single request is most likely a synchronous call: send it now.  (In a burst
            # the submitter holds the GIL while we wake, so we find several queued.)
            if self._queued() <= 1 or self._stopping():
                return
            deadline = time.monotonic() + cycle
            seen = self._queued()
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(min(remaining, _BURST_GAP_S))
                if self._queued() == seen or self._stopping():
                    return
                seen = self._queued()

    def _cycle(self) -> bool:
        """One cycle under the lock; once it ends the engine (a stop, a failure, an exception
        raised through a waiter), no thread runs another."""
        self.cycles += 1
        going = False
        try:
            going = self._run_cycle()
        finally:
            if not going:
                self.ended = True
        return going

    def run_until_done(self, handle: Any) -> None:
        """Run cycles on this thread until ``handle`` is done, if no cycle is running now.

        Returns at once (the caller then waits as usual) on the engine thread itself, in a CUDA
        job, once the engine has ended, or while another thread runs a cycle (then the engine
        thread is woken: a blocking call's submission did not wake it).  An exception raised
        here (a KeyboardInterrupt in a round) has already ended the engine on this rank.
        """
        if (not self.inline_allowed or self.ended or self.thread is None
                or threading.current_thread() is self.thread):
            return  # (a CUDA job's submissions wake the engine thread themselves)
        if not self._lock.acquire(blocking=False):
            self.wake()
            return
        self.waiter_running = True
        try:
            while not handle.done() and not self.ended:
                self.inline_cycles += 1
                if not self._cycle():
                    break
        finally:
            self.waiter_running = False
            self._lock.release()
        if self._queued() or self._stopping():
            self.wake()  # other threads' submissions, queued meanwhile


__all__ = ["CycleDriver"]
