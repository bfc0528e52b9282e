"""The c10d progress thread ends cleanly at exit, after finishing what it was handed; the
futures' callbacks run where one blocking on another's future cannot hang."""

import threading

from mpitrain.torch.c10d.work import Progress, Resolver


class FakeWork:
    """Stands in for a Work: done after ``polls`` polls; records its completion."""

    def __init__(self, polls: int = 0) -> None:
        self.polls_left = polls
        self.completed = threading.Event()

    def polled_done(self) -> bool:
        self.polls_left -= 1
        return self.polls_left < 0

    def complete(self):
        self.completed.set()
        return lambda: None  # what resolves its future


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


def test_a_callback_waiting_for_a_later_completion_does_not_block_it():
    """As torch's powerSGD_hook does: a future's callback waits for another collective's
    future, whose completion is queued after it. A second thread must take that one."""
    resolver = Resolver("test")
    later_done = threading.Event()
    waited = []
    resolver.submit(lambda: waited.append(later_done.wait(timeout=10)))
    resolver.submit(later_done.set)
    resolver.stop(timeout=10)
    assert waited == [True]
    assert resolver.threads() == 2


def test_completions_reuse_idle_threads():
    resolver = Resolver("test-idle")
    for _ in range(20):
        done = threading.Event()
        resolver.submit(done.set)
        assert done.wait(timeout=10)
    resolver.stop(timeout=10)
    # Reused, not one per completion (a second appears when a job comes before the first
    # thread is back to waiting).
    assert resolver.threads() < 10
