"""``auto`` across nodes: try the contenders on the first real buckets, keep the fastest.

Across nodes the best allreduce depends on the link, which no size table can know: on the
2x2 namespace cluster MPI's own Allreduce wins on a 1 Gbit/s link (it reaches the link's
limit, our hierarchical allreduce about 60% of it), hierarchical wins 3x on an unshaped one,
and with one rank per host our ring wins on the same 1 Gbit/s link.  So for each size class
(powers of two) the first ``TRIALS x len(contenders)`` large allreduces run the contenders one
after another, ``TRIALS`` consecutive calls each, on the real data (every trial is a correct
allreduce).  Consecutive, because that is how the chosen one will run (taking turns call by
call measures each contender after the others' traffic, with its own connections idle).  On
the 10 Gbit/s namespace cluster MPI's own still measured slower in its trials than in steady
use (32 MiB: 97-146 ms in a row, 116-160 ms taking turns, 53-117 ms after ten warm calls,
2026-11-27): the first calls after ``init()`` cost more, and its times vary most.  Each
trial's time is the slowest rank's, agreed with one small MAX-allreduce; then the earliest
contender (MPI's own, the layout's choice, the ring) whose median trial time is within
:data:`MARGIN` of the fastest one's is the provisional choice.  Leaving MPI's own takes a
second look: MPI's own and the provisional choice run ``TRIALS`` more calls each, head to
head, and the same rule on those decides between the two.  Three trials of a ~3 ms call on
shared cores can mislead (2 x 2 namespace hosts, unshaped, 1 MiB, 2026-11-27: hierarchical's
trials 2.4-2.7 ms against MPI's 3.2-3.6 ms, then 4.5 ms per call against MPI's 2.1-3.2 ms),
and falling under MPI's own is the one thing auto must not do; two samples taken at different
times must both agree before it is left.  Every rank sees the same agreed times, makes the
same choice and runs the same algorithm: no disagreement, no hang.

Trials cost a job's first steps, so they stop early where the answer is plain: a contender
whose first two trials take more than :data:`PRUNE` times the best median so far runs no more
(MPI's own after one: it sets nothing of ours up), and the second look lets the provisional
choice go first and stops MPI's own after one call when both its first-round median and that
call are :data:`PRUNE` times slower.  For 16-bit buffers MPI's own runs last in the first
round, so that it can be cut: it widens them, and on 2 x 2 namespace hosts at 1 Gbit/s a
16 MiB float16 bucket took 660 ms on its path against hierarchical's 96 ms (2026-11-29);
running it first, three times, made a job's first 20 steps with ``Compression.fp16`` cost
2.2x as many steady ones; and where its one call lost by more than :data:`NARROW_SURE`, no
second look is needed.  Decisions are kept across runs (:mod:`.calibration_cache`): a job
started again on the same layout and link starts with them and runs no trials, only a check
of each on its first ``CHECK_CALLS`` calls against the time it was decided with.

A class first met in the middle of a job (gradients fused into one bucket where they usually
make two) is no new question: its neighbours have answered most of it.  A contender that lost
plainly in an adjacent class of the same element width (its median more than :data:`PRUNE`
times the choice's in every round it ran) does not run there, unless the other neighbour chose
it; where MPI's own is left out so, the second look is not needed either (the neighbour had
its own).  On 2 x 2 namespace hosts at 1 Gbit/s, ``Compression.fp16``'s two 8 MiB buckets
sometimes fused into one of 16 MiB, a class of its own: its trial of MPI's own took 0.9-2.1 s
against hierarchical's 0.15-0.24 s, the single stalled steps of that training (2026-11-29).

Used only across several nodes, from ``algorithms.CALIBRATION_MIN_BYTES`` up (16-bit buffers
from ``NARROW_CALIBRATION_BYTES``); one node keeps the measured table, where shared memory wins
by 2-3x.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpi4py import MPI

# Per contender and size class; their median counts: one spike (another job, the first
# call's set-up or cold connections) does not decide, and an algorithm that is fast only
# sometimes (two TCP flows sharing a shaped link stall now and then) is judged by its usual
# time.
TRIALS = 3
# A later contender replaces an earlier one only when its median is at least this much
# smaller: ours can stall now and then where MPI's does not (seen on shaped links, 2026-11-26),
# and a near tie in three trials is not worth that risk; MPI's own is the bar auto must not
# fall under.
MARGIN = 0.10
# A choice an earlier run left is checked on this job's first calls of its size class (the
# fastest of them: the first also pays for setting the algorithm up) against the time it took
# when it was decided; beyond this factor either way the link is not the one it was decided
# on (a 2 MiB probe told unshaped veth from a 1 Gbit/s link by less than 2x on 2 cores, and
# the 1 Gbit/s cluster's choice of MPI's own ran unshaped at 0.46x hierarchical's speed),
# so the class is calibrated again.
CHECK_CALLS = 2
CHECK_TOLERANCE = 1.3
# A contender this many times slower than the best so far is out after one trial: the trials
# are real training steps, and three calls of an algorithm that plainly loses are a tax.
PRUNE = 1.5
# On 16-bit buffers MPI's own moves twice the bytes and converts them twice: a first-round loss
# by more than this factor is not a near tie that a second sample could overturn, so it needs
# no second look.  On 2 x 2 namespace hosts at 1 Gbit/s its calls there took 0.55-2.5 s against
# hierarchical's 0.09-0.6 s (4-7x); the second look's one more call was a second stalled step
# in every fresh job using Compression.fp16 (2026-11-29).
NARROW_SURE = 2.0

Key = tuple[bool, int]  # (16-bit element type, size class)


@dataclass(frozen=True)
class Settled:
    """One size class's decision, as the cache keeps it across runs."""

    choice: str
    seconds: float | None = None  # the choice's median trial time (slowest rank)
    # Contenders that lost plainly (see Calibration.losers): the neighbours' evidence.
    losers: frozenset[str] = frozenset()


def calls_to_decide(contenders: int) -> int:
    """The most allreduces of one size class before its choice is made: ``TRIALS`` of each
    contender, then ``TRIALS`` each of MPI's own and the provisional choice."""
    return TRIALS * (contenders + 2)


@dataclass
class Calibration:
    """The trials and decisions of one group (one process set's data plane)."""

    contenders: tuple[str, ...]
    clock: Callable[[], float] = time.perf_counter
    verbose: bool = False  # say each decision on stderr (rank 0 at log level INFO or lower)
    trials: dict[Key, list[tuple[str, float]]] = field(default_factory=dict)
    decided: dict[Key, str] = field(default_factory=dict)
    # The first round's choice where it is not MPI's own, until the second look decides.
    provisional: dict[Key, str] = field(default_factory=dict)
    # Trials of the first round, once it is over (the second look's come after them).
    first_round: dict[Key, int] = field(default_factory=dict)
    # Told every decision made by trials (not those given at the start): the cache's writer.
    on_settle: Callable[[Key, Settled], None] | None = None
    # Per decided class, the contenders whose median was more than PRUNE times the choice's
    # in every round they both ran: adjacent classes leave them out of their trials.
    losers: dict[Key, frozenset[str]] = field(default_factory=dict)
    # Choices given at the start with the time they took when decided (seconds): checked on
    # the first calls of their class (see CHECK_TOLERANCE), then dropped from here.
    expected: dict[Key, float] = field(default_factory=dict)
    checks: dict[Key, list[float]] = field(default_factory=dict)

    @staticmethod
    def size_class(nbytes: int, narrow: bool = False) -> tuple[bool, int]:
        """Sizes in [2^(k-1), 2^k) share class k; 16-bit element types (``narrow``) are
        classes of their own, since MPI's path widens them and the contenders rank
        differently on them."""
        return narrow, int(nbytes).bit_length()

    def choice(self, nbytes: int, narrow: bool = False) -> str | None:
        """The decided algorithm for this size, or None while it is still being measured.

        A round can end between two calls of its class: a neighbour decided meanwhile and left
        out the contenders still to run here (see :meth:`_entrants`; 2 x 2 hosts at 1 Gbit/s
        with ``Compression.fp16``: the fused 16 MiB class had run all but MPI's own when the
        8 MiB class saw MPI's own lose plainly).  Such a round is concluded here, from the
        trials it has, as its last trial would have concluded it; every rank holds the same
        trials and decisions at this call, so every rank concludes alike.
        """
        key = self.size_class(nbytes, narrow)
        decided = self.decided.get(key)
        if decided is None and key in self.trials and self._next(key) is None:
            self._conclude(key)
            decided = self.decided.get(key)
        return decided

    def checking(self, nbytes: int, narrow: bool = False) -> bool:
        """Whether the next call of this size runs a given choice under its check."""
        return self.size_class(nbytes, narrow) in self.expected

    def run_check(self, comm: Any, nbytes: int, allreduce: Callable[[], None],
                  narrow: bool = False) -> None:
        """Run ``allreduce`` (the given choice) timed; collective over ``comm``.  After
        ``CHECK_CALLS`` calls, a choice whose fastest call is not within ``CHECK_TOLERANCE``
        of the time it was decided with is forgotten: the next calls are trials.  Every rank
        sees the same slowest-rank times, so all forget it or none."""
        key = self.size_class(nbytes, narrow)
        start = self.clock()
        allreduce()
        slowest = float(comm.allreduce(self.clock() - start, op=MPI.MAX))
        times = self.checks.setdefault(key, [])
        times.append(slowest)
        if len(times) < CHECK_CALLS:
            return
        expected = self.expected.pop(key)
        ratio = min(times) / expected
        if 1 / CHECK_TOLERANCE <= ratio <= CHECK_TOLERANCE:
            return
        choice = self.decided.pop(key)
        # What lost there was measured on the link that no longer holds: its neighbours must
        # not leave anything out on its word.
        self.losers.pop(key, None)
        if self.verbose:
            sys.stderr.write(f"{self._head(key, choice)} no longer: it took "
                             f"{min(times) * 1e3:.1f} ms, {ratio:.2f}x the "
                             f"{expected * 1e3:.1f} ms it was chosen with; calibrating again\n")

    def next_trial(self, nbytes: int, narrow: bool = False) -> str:
        """The contender the next allreduce of this size class runs (``TRIALS`` in a row,
        unless it was pruned, see the module docstring)."""
        key = self.size_class(nbytes, narrow)
        name = self._next(key)
        assert name is not None, "next_trial after the decision"
        return name

    def _entrants(self, key: Key) -> tuple[str, ...]:
        """The contenders of this class: all but those an adjacent class of the same width saw
        lose plainly, unless the other adjacent class chose them.  At the sizes calibrated,
        each algorithm's time grows with the bytes, so one that took more than PRUNE times the
        best at half or twice the size is not the best here (and where an adjacent class chose
        it, the classes are near a crossover: it runs).  Asked again at every call: a
        neighbour decided while this class's trials run (both met in the same steps) still
        spares the calls not yet made; a contender that has run here stays in.  Never empty:
        a decided neighbour's choice is not its loser."""
        narrow, bits = key
        near = [(narrow, bits - 1), (narrow, bits + 1)]
        lost = set().union(*(self.losers.get(k, frozenset()) for k in near))
        lost -= {self.decided[k] for k in near if k in self.decided}
        lost -= {n for n, _ in self.trials.get(key, [])}
        return tuple(c for c in self.contenders if c not in lost)

    def _round(self, key: Key) -> tuple[tuple[str, ...], list[tuple[str, float]]]:
        """This round's contenders in running order, and its trials so far."""
        trials = self.trials.get(key, [])
        if key not in self.first_round:
            entrants = self._entrants(key)
            narrow, _ = key
            if narrow and entrants[0] == self.contenders[0]:
                # MPI's own widens 16-bit buffers (twice the bytes, two casts): it runs last,
                # so that the others' times can cut it short after one call (see _pruned).
                return (*entrants[1:], entrants[0]), trials
            return entrants, trials
        # The second look: the provisional choice first, so MPI's own can be cut short.
        return (self.provisional[key], self.contenders[0]), trials[self.first_round[key]:]

    def _next(self, key: Key) -> str | None:
        """Who runs next in this round, or None when the round is over."""
        order, trials = self._round(key)
        for name in order:
            times = [t for n, t in trials if n == name]
            if len(times) < TRIALS and not (times and self._pruned(key, name, times, trials)):
                return name
        return None

    def _pruned(self, key: Key, name: str, times: list[float],
                trials: list[tuple[str, float]]) -> bool:
        """Whether ``name`` (with ``times`` this round) runs no more trials this round."""
        others = [statistics.median(t for n, t in trials if n == other)
                  for other in {n for n, _ in trials if n != name}]
        if not others or min(times) <= PRUNE * min(others):
            return False
        if key not in self.first_round:
            # Two slow calls, not one: a first call of ours also pays for setting its
            # algorithm up.  MPI's own sets nothing up of ours, and where it can be cut it ran
            # after the others, over connections they opened: one call tells.
            return len(times) >= (1 if name == self.contenders[0] else 2)
        # The second look: only MPI's own can be cut, and only when the first round said so
        # too -- two observations at different times, as the second look is there for.
        first = self.trials[key][:self.first_round[key]]
        mine = statistics.median(t for n, t in first if n == name)
        best = statistics.median(t for n, t in first if n == self.provisional[key])
        return mine > PRUNE * best

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
        self.trials.setdefault(key, []).append((name, slowest))
        if self._next(key) is None:
            self._conclude(key)

    def _conclude(self, key: Key) -> None:
        """End the round that has no trial left: decide, or take the first round's winner
        into the second look."""
        _, trials = self._round(key)
        # Decided in order of preference (MPI's own first), whatever order the calls ran in.
        mpi = self.contenders[0]
        choice = self._decide(trials, (mpi, self.provisional[key])
                              if key in self.first_round else self._entrants(key))
        if key in self.first_round:
            self._settle(key, choice)
        elif choice == mpi or mpi not in self._entrants(key) or self._narrow_loss(key, trials,
                                                                                 choice):
            self.first_round[key] = len(self.trials[key])
            self._settle(key, choice)
        else:
            self.first_round[key] = len(self.trials[key])
            self.provisional[key] = choice

    def _narrow_loss(self, key: Key, trials: list[tuple[str, float]], choice: str) -> bool:
        """Whether MPI's own lost a 16-bit class's first round by more than NARROW_SURE."""
        narrow, _ = key
        mine = [t for n, t in trials if n == self.contenders[0]]
        if not (narrow and mine):
            return False
        return min(mine) > NARROW_SURE * statistics.median(t for n, t in trials if n == choice)

    def _settle(self, key: Key, choice: str) -> None:
        self.decided[key] = choice
        self.losers[key] = self._plain_losers(key, choice)
        if self.on_settle is not None:
            seconds = statistics.median(t for n, t in self._rounds(key)[-1] if n == choice)
            self.on_settle(key, Settled(choice, seconds, self.losers[key]))
        if self.verbose:
            sys.stderr.write(self.describe(key) + "\n")

    def _rounds(self, key: Key) -> list[list[tuple[str, float]]]:
        """The class's trials, by round: the first, then the second look if it ran."""
        trials = self.trials.get(key, [])
        first = self.first_round.get(key, len(trials))
        return [trials[:first]] + ([trials[first:]] if trials[first:] else [])

    def _plain_losers(self, key: Key, choice: str) -> frozenset[str]:
        """The contenders whose median was more than PRUNE times the choice's in every round
        where both ran (and that ran in one)."""
        verdicts: dict[str, list[bool]] = {}
        for trials in self._rounds(key):
            best = [t for n, t in trials if n == choice]
            for name in {n for n, _ in trials if n != choice} if best else ():
                mine = statistics.median(t for n, t in trials if n == name)
                verdicts.setdefault(name, []).append(mine > PRUNE * statistics.median(best))
        return frozenset(name for name, lost in verdicts.items() if all(lost))

    def describe(self, key: Key) -> str:
        """One line: the size class, what it runs and the trial medians that chose it."""
        first = self.first_round.get(key, len(self.trials.get(key, [])))

        def medians(trials: list[tuple[str, float]], names: tuple[str, ...]) -> str:
            return ", ".join(f"{c} {statistics.median(t for n, t in trials if n == c) * 1e3:.1f}"
                             f" ms" + ("" if sum(n == c for n, _ in trials) >= TRIALS
                                       else " (cut short)")
                             for c in names if any(n == c for n, _ in trials))

        head = self._head(key, self.decided[key])
        if key not in self.trials:
            return head + " (decided by an earlier run: see MPITRAIN_CALIBRATION_CACHE)"
        again = self.provisional.get(key)
        second = (f"; then {medians(self.trials[key][first:], (again, self.contenders[0]))}"
                  if again and len(self.trials[key]) > first else "")
        left_out = [c for c in self.contenders if c not in self._entrants(key)]
        skipped = (f"; {', '.join(left_out)} not tried: plainly slower at an adjacent size"
                   if left_out else "")
        return (f"{head} (median of up to {TRIALS} trials, slowest rank: "
                f"{medians(self.trials[key][:first], self.contenders)}{second}{skipped})")

    @staticmethod
    def _head(key: Key, choice: str) -> str:
        narrow, bits = key
        low, high = (1 << (bits - 1)) if bits else 0, 1 << bits
        return (f"mpitrain: auto across nodes: allreduces of {_size(low)}-{_size(high)}"
                f"{' (16-bit)' if narrow else ''} run {choice}")

    @staticmethod
    def _decide(trials: list[tuple[str, float]], contenders: tuple[str, ...]) -> str:
        """The earliest of ``contenders`` within :data:`MARGIN` of the fastest median.

        The contenders come in order of preference (MPI's own, then the layout's choice, then
        the flat ring), so a later one replaces an earlier one only when clearly faster: MPI's
        own is the bar auto must not fall under, and hierarchical moves fewer bytes across
        nodes than the ring (on 2 x 2 namespace hosts the ring won trials by 1-3% at 10 Gbit/s
        and unshaped, 58.2 vs 59.8 ms and 47.0 vs 47.9 ms for 32 MiB float16, then took 76
        against hierarchical's 64 ms in steady use, 2026-11-27).
        """
        median = {c: statistics.median(t for n, t in trials if n == c) for c in contenders}
        fastest = min(median.values())
        return next(c for c in contenders if fastest > (1.0 - MARGIN) * median[c]
                    or median[c] == fastest)

    def summary(self) -> dict[Key, dict[str, Any]]:
        """Per size class: the trial times (seconds, slowest rank) and the decision."""
        return {key: {"trials": list(trials), "provisional": self.provisional.get(key),
                      "decided": self.decided.get(key)}
                for key, trials in sorted(self.trials.items())}


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"
