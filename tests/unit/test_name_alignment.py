"""Aligning the unnamed-request counters (SetRegistry.align_names) against a name drawn while
the alignment's exchange is in flight.

Found by the bad-input properties at 2 ranks (one run in five): rank 1's lone broadcast was
given up; its exchange released it, it met rank 0 in the test's own allgather, and rank 0's
program drew its next allreduce name while rank 0's engine thread still held the counts it had
read before the exchange, which it then wrote back: rank 0 drew the same name twice and was
one behind rank 1 from then on (a deadlock at the next unnamed allreduce).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from mpitrain.engine.request import Kind, generated_name
from mpitrain.engine.set_registry import SetRegistry


class _HeldExchange:
    """A communicator whose MAX-allreduce finishes only when ``release`` is set, and then
    brings in another rank's counts (``theirs``)."""

    def __init__(self, theirs: dict[Kind, int]) -> None:
        self.theirs = theirs
        self.started = threading.Event()
        self.release = threading.Event()

    def Iallreduce(self, _inplace, counts, op):  # noqa: N802 - mpi4py's name
        outer = self

        class Request:
            def Test(self):  # noqa: N802
                outer.started.set()
                if not outer.release.is_set():
                    return False
                for kind, count in outer.theirs.items():
                    counts[list(Kind).index(kind)] = max(counts[list(Kind).index(kind)], count)
                return True

        return Request()


def _registry_with(counters: dict[Kind, int], comm: _HeldExchange) -> tuple[SetRegistry, object]:
    registry = SetRegistry(threading.Condition(), None, None, None, lambda: 0)  # type: ignore[arg-type]
    state = SimpleNamespace(name_counters=dict(counters),
                            negotiator=SimpleNamespace(pending={}, comm=comm))
    registry.states[0] = state  # type: ignore[assignment]
    return registry, state


def test_a_name_drawn_during_the_exchange_waits_for_the_aligned_count():
    comm = _HeldExchange({Kind.ALLREDUCE: 5})
    registry, state = _registry_with({Kind.ALLREDUCE: 3}, comm)
    aligner = threading.Thread(target=registry.align_names, args=(state, True), daemon=True)
    aligner.start()
    assert comm.started.wait(5)
    drawn: list[str] = []
    namer = threading.Thread(target=lambda: drawn.append(registry.next_name(0, Kind.ALLREDUCE)),
                             daemon=True)
    namer.start()
    time.sleep(0.2)
    drawn_early = list(drawn)
    comm.release.set()  # before any assert: the aligner must not outlive the test
    aligner.join(5)
    assert not drawn_early, "a name was drawn from the counts the alignment is about to replace"

    namer.join(5)
    assert drawn == [generated_name(Kind.ALLREDUCE, 5, 0)]
    assert registry.next_name(0, Kind.ALLREDUCE) == generated_name(Kind.ALLREDUCE, 6, 0)


def test_counts_are_left_alone_while_some_rank_still_has_requests_pending():
    comm = _HeldExchange({Kind.BROADCAST: 9})
    registry, state = _registry_with({Kind.BROADCAST: 2}, comm)
    state.negotiator.pending["x"] = object()  # type: ignore[attr-defined]
    comm.release.set()
    registry.align_names(state, only_if_quiet=True)  # type: ignore[arg-type]
    assert registry.next_name(0, Kind.BROADCAST) == generated_name(Kind.BROADCAST, 2, 0)
    registry.align_names(state)  # type: ignore[arg-type]  # a join: always aligned
    assert registry.next_name(0, Kind.BROADCAST) == generated_name(Kind.BROADCAST, 9, 0)
