"""The c10d progress thread ends cleanly at exit, after finishing what it was handed."""

import threading

from mpitrain.torch.c10d.work import Progress


class FakeWork:
    """Stands in for a Work: done after ``polls`` polls; records its completion."""

    def __init__(self, polls: int = 0) -> None:
        self.polls_left = polls
        self.completed = threading.Event()

    def polled_done(self) -> bool:
        self.polls_left -= 1
        return self.polls_left < 0

    def complete(self) -> None:
        self.completed.set()


def _thread_of(progress: Progress) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == "mpitrain-c10d-test")


def test_stop_finishes_handed_works_then_ends_the_thread():
    progress = Progress("test")
    ready, polled = FakeWork(), FakeWork(polls=50)
    progress.ready(ready)
    progress.watch(polled)
    thread = _thread_of(progress)
    progress.stop(timeout=10)
    assert ready.completed.is_set() and polled.completed.is_set()
    assert not thread.is_alive()


def test_stop_without_a_thread_is_harmless():
    Progress("never-started").stop()
