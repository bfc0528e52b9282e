"""torch.distributed Work objects for the mpitrain backend, and the thread that completes them.

torch's contract: a collective returns a Work at once; ``wait()`` blocks until it is done (and
raises its error); ``get_future()`` is a ``torch.futures.Future`` completed with the output
tensors when the operation finishes, whether or not anybody calls ``wait()`` (stock DDP only
chains callbacks on the future).  Something must therefore complete futures on its own:

* engine collectives call back (``Handle.add_done_callback``, on the engine thread) into a
  per-process-group :class:`Progress` thread, which runs the Work's finishing step (copying
  results into torch's output tensors) and hands the future's completion to a
  :class:`Resolver`.  Future callbacks, which are user code, thus never run on the engine
  thread, nor on the progress thread: a callback may block on another collective's future
  (torch's ``powerSGD_hook`` does, ``all_reduce(...).get_future().wait()`` inside ``then``),
  and that future must still be completed by someone — the resolver starts another thread
  whenever every one of its threads is busy, so a blocked callback never blocks the
  completion it waits for (with one thread that was a hang: torch DDP with torch's PowerSGD
  hook over this backend, e.g. Accelerate's ``comm_hook=POWER_SGD``);
* point-to-point Works hold an MPI request that only the progress thread tests, backing off
  from yields to 1 ms sleeps while any is pending, so nothing spins.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...core.errors import MpitrainInternalError

_MAX_SLEEP_S = 1e-3
# At exit, how long the thread may go on finishing Works handed to it before it is left behind.
_STOP_TIMEOUT_S = 5.0


def _seconds(timeout: Any) -> float | None:
    """torch passes kNoTimeout (a negative duration) or a timedelta; None means forever."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout) / 1e3  # C++ callers pass milliseconds
    return None if seconds <= 0 else seconds


def _value_or_raise(done: torch.futures.Future) -> Any:
    return done.value()  # raises the exception a failed Work was completed with


class Work(dist._Work):
    """One operation of the mpitrain process group.

    Args:
        outputs: what ``result()`` and the future's value are (the output tensors).
        finish: run once on the progress thread when the transport is done; raises on failure.
        poll: for point-to-point Works, returns True once the MPI request has completed.
        describe: a short name for error messages.
    """

    def __init__(self, outputs: list[Any], finish: Callable[[], None] | None = None,
                 poll: Callable[[], bool] | None = None, describe: str = "operation") -> None:
        super().__init__()
        self._outputs = outputs
        self._finish = finish
        self._poll = poll
        self._describe = describe
        # What we complete, and what get_future() hands out: a future chained on it, because
        # only a callback that raises gives a future a C++-level error.  Python's
        # set_exception stores the exception as the *value*, which C++ readers (torch's DDP
        # reducer) take for the result: they would read tensors out of an exception object
        # (a segfault) instead of raising.
        self._done: torch.futures.Future = torch.futures.Future()
        self._future: torch.futures.Future = self._done.then(_value_or_raise)
        self._event = threading.Event()
        self._error: BaseException | None = None
        self.source_rank_value = -1

    # ------------------------------------------------------------------ progress side
    def complete(self) -> Callable[[], None]:
        """Finish on the progress thread: run the finishing step, release ``wait()``; returns
        what resolves the future (which runs its callbacks: for a :class:`Resolver`)."""
        try:
            if self._finish is not None:
                self._finish()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter and the future
            self._error = exc
        self._finish = None
        self._event.set()
        return self._resolve

    def _resolve(self) -> None:
        if self._error is None:
            self._done.set_result(self._outputs)
        else:
            error = self._error if isinstance(self._error, Exception) else RuntimeError(
                str(self._error))
            self._done.set_exception(error)

    def polled_done(self) -> bool:
        assert self._poll is not None
        try:
            return self._poll()
        except BaseException as exc:  # noqa: BLE001 - an MPI error ends this Work
            self._error = exc
            return True

    # ------------------------------------------------------------------ torch's API
    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation finished; raise its error if it failed.

        Raises:
            MpitrainInternalError: the operation failed, or ``timeout`` passed first.
        """
        seconds = _seconds(timeout)
        if not self._event.wait(seconds):
            raise MpitrainInternalError(f"mpitrain backend: {self._describe} did not finish "
                                        f"within {seconds} s")
        if self._error is not None:
            if isinstance(self._error, (MpitrainInternalError, ValueError, TypeError)):
                raise self._error
            raise MpitrainInternalError(f"mpitrain backend: {self._describe} failed: "
                                        f"{self._error}") from self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[Any]:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        return self.source_rank_value

    def source_rank(self) -> int:
        return self.source_rank_value

    def synchronize(self) -> None:
        self.wait()


class Resolver:
    """Threads that complete Works' futures, and so run their callbacks (user code).

    Every queued completion has a thread of its own to run on: when none is idle, one more is
    started.  A callback that blocks on another Work's future (torch's PowerSGD hook) then
    never stands in the way of that future's completion.  Threads stay for later completions;
    they are as many as callbacks were ever blocked at once, plus one.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._jobs: deque[Callable[[], None]] = deque()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._stopping = False

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._jobs.append(job)
            # More jobs waiting than idle threads to take them: one of them would wait behind
            # a callback that may be waiting for it.
            if len(self._jobs) > self._idle:
                thread = threading.Thread(target=self._run, daemon=True,
                                          name=f"mpitrain-c10d-{self._name}-"
                                               f"futures{len(self._threads)}")
                self._threads.append(thread)
                thread.start()
            else:
                self._cond.notify()

    def threads(self) -> int:
        with self._cond:
            return len(self._threads)

    def stop(self, timeout: float) -> None:
        """Run what was submitted, then end the threads (waiting at most ``timeout`` s)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if self._stopping:
                        return
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                job = self._jobs.popleft()
            job()


class Progress:
    """The thread that completes one process group's Works (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._ready: list[Work] = []
        self._new_polls: list[Work] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._resolver = Resolver(name)

    def ready(self, work: Work) -> None:
        """``work``'s transport is done: finish it soon.  Callable from any thread."""
        with self._cond:
            self._ready.append(work)
            self._start_locked()
            self._cond.notify()

    def watch(self, work: Work) -> None:
        """Poll ``work`` (an MPI request) until it completes, then finish it."""
        with self._cond:
            self._new_polls.append(work)
            self._start_locked()
            self._cond.notify()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"mpitrain-c10d-{self._name}",
                                             daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Finish the Works already handed over, then end the thread (registered at exit).

        A daemon thread still running at the interpreter's finalization is ended by
        ``pthread_exit``; caught inside torch (completing a Work's future) that aborts the
        whole process (seen once in CI: "signal 6" after the training had finished).
        """
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            started = time.monotonic()
            thread.join(timeout)
            timeout = max(0.0, timeout - (time.monotonic() - started))
        self._resolver.stop(timeout)

    def _run(self) -> None:
        polling: list[Work] = []
        sleep = 0.0
        while True:
            with self._cond:
                if not self._ready and not self._new_polls:
                    if self._stopping and not polling:
                        return
                    self._cond.wait(sleep if polling else None)
                ready, self._ready = self._ready, []
                polling.extend(self._new_polls)
                self._new_polls = []
            for work in ready:
                self._resolver.submit(work.complete())
            still = []
            for work in polling:
                if work.polled_done():
                    self._resolver.submit(work.complete())
                else:
                    still.append(work)
            progressed = bool(ready) or len(still) < len(polling)
            polling = still
            # Back off while requests stay pending: yield first, then sleep up to 1 ms.
            sleep = 0.0 if progressed else min(_MAX_SLEEP_S, max(sleep * 2, 2e-5))
            if polling and sleep == 0.0:
                time.sleep(0)


__all__ = ["Progress", "Resolver", "Work"]
