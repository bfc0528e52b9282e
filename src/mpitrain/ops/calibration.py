"""``auto`` across nodes: try the contenders on the first real buckets, keep the fastest.

Across nodes the best allreduce depends on the link, which no size table can know: on the
2x2 namespace cluster MPI's own Allreduce wins on a 1 Gbit/s link (it reaches the link's
limit, our hierarchical allreduce about 60% of it), hierarchical wins 3x on an unshaped one,
and with one rank per host our ring wins on the same 1 Gbit/s link.  So for each size class
(powers of two) the first ``TRIALS x len(contenders)`` large allreduces each run one contender
in turn, on the real data (every trial is a correct allreduce); each trial's time is the
slowest rank's, agreed with one small MAX-allreduce; then the contender with the smallest
median trial time is kept for that class, unless MPI's own is within :data:`MARGIN` of it
(then MPI's own is kept).  Every rank sees the same agreed times, makes the same choice and
runs the same algorithm: no disagreement, no hang.

Used only where ``auto`` would otherwise pick by table across several nodes (from
``MPI_MAX_BYTES`` up); one node keeps the measured table, where shared memory wins by 2-3x.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

# Per contender and size class; their median counts: one spike (another job, the first
# call's set-up) does not decide, and an algorithm that is fast only sometimes (two TCP
# flows sharing a shaped link stall now and then) is judged by its usual time.
TRIALS = 3
# Another contender replaces MPI's own only when its median is at least this much smaller:
# ours can stall now and then where MPI's does not (seen on shaped links, 2026-11-26), and a
# near tie in the trials is not worth that risk; MPI's own is the bar auto must not fall under.
MARGIN = 0.10
SAFE = "mpi"


@dataclass
class Calibration:
    """The trials and decisions of one group (one process set's data plane)."""

    contenders: tuple[str, ...]
    clock: Callable[[], float] = time.perf_counter
    trials: dict[tuple[bool, int], list[tuple[str, float]]] = field(default_factory=dict)
    decided: dict[tuple[bool, int], str] = field(default_factory=dict)

    @staticmethod
    def size_class(nbytes: int, narrow: bool = False) -> tuple[bool, int]:
        """Sizes in [2^(k-1), 2^k) share class k; 16-bit element types (``narrow``) are
        classes of their own, since MPI's path widens them and the contenders rank
        differently on them."""
        return narrow, int(nbytes).bit_length()

    def choice(self, nbytes: int, narrow: bool = False) -> str | None:
        """The decided algorithm for this size, or None while it is still being measured."""
        return self.decided.get(self.size_class(nbytes, narrow))

    def next_trial(self, nbytes: int, narrow: bool = False) -> str:
        """The contender the next allreduce of this size class runs (round robin)."""
        done = len(self.trials.get(self.size_class(nbytes, narrow), []))
        return self.contenders[done % len(self.contenders)]

    def run_trial(self, comm: Any, nbytes: int, name: str, allreduce: Callable[[], None],
                  narrow: bool = False) -> None:
        """Run ``allreduce`` (the contender ``name``) timed; collective over ``comm``.

        The time recorded is the slowest rank's (a collective ends when its last rank does),
        so every rank records the same number and later decides the same way.
        """
        start = self.clock()
        allreduce()
        elapsed = self.clock() - start
        slowest = float(comm.allreduce(elapsed, op=MPI.MAX))
        key = self.size_class(nbytes, narrow)
        trials = self.trials.setdefault(key, [])
        trials.append((name, slowest))
        if len(trials) >= TRIALS * len(self.contenders):
            self.decided[key] = self._decide(trials)

    def _decide(self, trials: list[tuple[str, float]]) -> str:
        """The fastest contender by median; MPI's own unless beaten by :data:`MARGIN`."""
        median = {c: statistics.median(t for n, t in trials if n == c) for c in self.contenders}
        # Ties go to the earlier contender: the same on every rank.
        best = min(self.contenders, key=lambda c: (median[c], self.contenders.index(c)))
        if SAFE in median and median[best] > (1.0 - MARGIN) * median[SAFE]:
            return SAFE
        return best

    def summary(self) -> dict[tuple[bool, int], dict[str, Any]]:
        """Per size class: the trial times (seconds, slowest rank) and the decision."""
        return {key: {"trials": list(trials), "decided": self.decided.get(key)}
                for key, trials in sorted(self.trials.items())}
