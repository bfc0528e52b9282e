"""Which thread runs the engine's cycles (engine/driver.py), with stand-ins for the engine.

Each test fails on the mechanism, not on a time: a waiter runs the cycles it waits for on its
own thread, a held lock sends it back to waiting (and wakes the engine thread), the engine
thread skips the wake-up a waiter already served, a CUDA job never runs cycles off the engine
thread, and an engine ended by either thread runs no cycle again.
"""

from __future__ import annotations

import threading
import time

import pytest

from mpitrain.core import survivors
from mpitrain.engine.driver import CycleDriver


class FakeHandle:
    def __init__(self) -> None:
        self._done = False

    def done(self) -> bool:
        return self._done


class FakeEngine:
    """Counts cycles per thread and wake-ups; the ``finish_after``-th cycle completes the
    handle; ``queued`` stands for the submissions waiting for a cycle."""

    def __init__(self, handle: FakeHandle, finish_after: int = 1, going: bool = True,
                 cycle_time_s: float = 0.001) -> None:
        self.handle = handle
        self.finish_after = finish_after
        self.going = going
        self.threads: list[str] = []
        self.queued = 0
        self.cond = CountingCondition()
        self.driver = CycleDriver(self.run_cycle, self.cond, lambda: self.queued,
                                  lambda: False, lambda: cycle_time_s)

    def run_cycle(self) -> bool:
        self.threads.append(threading.current_thread().name)
        if len(self.threads) >= self.finish_after:
            self.handle._done = True
        return self.going

    @property
    def wakes(self) -> int:
        return self.cond.notified


class CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_a_waiter_runs_the_cycles_it_waits_for_on_its_own_thread():
    handle = FakeHandle()
    engine = FakeEngine(handle, finish_after=3)
    engine.driver.thread = threading.Thread(name="not-started")  # the engine thread exists
    engine.driver.run_until_done(handle)
    assert handle.done()
    assert engine.threads == [threading.current_thread().name] * 3
    assert engine.driver.cycles == engine.driver.inline_cycles == 3


def test_a_held_lock_sends_the_waiter_back_and_wakes_the_engine_thread():
    handle = FakeHandle()
    engine = FakeEngine(handle)
    engine.driver.thread = threading.Thread(name="not-started")
    with engine.driver._lock:  # another thread is running a cycle
        engine.driver.run_until_done(handle)
    assert engine.threads == [] and not handle.done()
    assert engine.wakes == 1  # the blocking call's submission did not wake it


def test_a_cuda_job_runs_every_cycle_on_the_engine_thread():
    handle = FakeHandle()
    engine = FakeEngine(handle)
    engine.driver.thread = threading.Thread(name="not-started")
    engine.driver.inline_allowed = False
    engine.driver.run_until_done(handle)
    # Its submissions woke the engine thread (Engine.submit): waiting adds no wake-up.
    assert engine.threads == [] and engine.wakes == 0


def test_the_engine_thread_itself_never_runs_cycles_as_a_waiter():
    handle = FakeHandle()
    engine = FakeEngine(handle)
    seen = []

    def as_engine_thread() -> None:
        engine.driver.run_until_done(handle)
        seen.append(list(engine.threads))

    engine.driver.thread = threading.Thread(target=as_engine_thread, name="mpitrain-engine")
    engine.driver.thread.start()
    engine.driver.thread.join()
    assert seen == [[]]


def test_the_engine_thread_skips_a_wake_up_a_waiter_already_served():
    handle = FakeHandle()
    # A long cycle time: the engine thread's timer never fires during the test (no idle round).
    engine = FakeEngine(handle, finish_after=10**9, cycle_time_s=30.0)
    driver = engine.driver
    driver.start()
    try:
        with driver._lock:  # a waiter runs the cycles while the engine thread waits
            driver.cycles += 1
            with engine.cond:
                engine.queued = 1
                engine.cond.notify()  # the submission's wake-up...
            time.sleep(0.05)
            with engine.cond:
                engine.queued = 0  # ...which the waiter's cycle served
        time.sleep(0.05)
        assert engine.threads == []
        with engine.cond:
            engine.queued = 1  # a submission nobody served: the engine thread runs it
            engine.cond.notify()
        deadline = time.monotonic() + 5
        while not engine.threads and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.threads[:1] == ["mpitrain-engine"]
    finally:
        driver.ended = True
        driver.wake()
        driver.thread.join(5)
    assert not driver.thread.is_alive()


@pytest.mark.parametrize("by", ["waiter", "engine thread"])
def test_an_ended_engine_runs_no_cycle_again_on_any_thread(by):
    handle = FakeHandle()
    engine = FakeEngine(handle, finish_after=10**9, going=False)  # the first cycle ends it
    driver = engine.driver
    if by == "waiter":
        driver.thread = threading.Thread(name="not-started")
        driver.run_until_done(handle)
    else:
        engine.queued = 1
        driver.start()
        driver.thread.join(5)
        assert not driver.thread.is_alive()
    assert driver.ended and len(engine.threads) == 1
    driver.thread = threading.Thread(name="not-started")
    driver.run_until_done(handle)  # a later waiter: nothing runs
    assert len(engine.threads) == 1


def test_an_exception_in_a_waiters_cycle_ends_the_engine():
    handle = FakeHandle()
    engine = FakeEngine(handle)
    driver = engine.driver
    driver.thread = threading.Thread(name="not-started")

    def interrupted() -> bool:
        raise KeyboardInterrupt

    driver._run_cycle = interrupted
    with pytest.raises(KeyboardInterrupt):
        driver.run_until_done(handle)
    assert driver.ended
    assert driver._lock.acquire(blocking=False)  # released on the way out


class FakeComm:
    def __init__(self, revoked: bool) -> None:
        self.revoked = revoked
        self.freed = False

    def Is_revoked(self) -> bool:  # noqa: N802 - mpi4py's name
        return self.revoked

    def Free(self) -> None:  # noqa: N802 - mpi4py's name
        self.freed = True


def test_a_revoked_communicator_is_kept_so_its_context_id_is_not_reused():
    live, revoked = FakeComm(False), FakeComm(True)
    survivors.release(live)
    survivors.release(revoked)
    assert live.freed and not revoked.freed
