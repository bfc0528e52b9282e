"""Stalls and deadlocks: which ranks are missing which requests, and what the user is told.

Separate from :mod:`.negotiation` because it is diagnosis, not agreement: it runs only when a
round's flags say that someone has waited too long (or that every rank is stuck), nothing the
normal rounds decide depends on it, and its messages are what a user reads when ranks submit
different collectives.  The :class:`~.negotiation.Negotiator` owns the state and forgets the
failed requests; this module gathers who has submitted what, decides when to look and when
to give up, and words the reports.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ..core.config import Config
from .request import Kind, Request


class Waiting(NamedTuple):
    """A request pending on some rank of the set, as :func:`gather_pending` found it."""

    name: str
    kind: Kind
    age: float  # seconds: the longest any rank has waited for it
    have: list[int]  # ranks of the set that submitted it
    missing: list[int]  # ranks of the set that did not (joined ranks are excused, see below)


def gather_pending(comm: Any, pending: Mapping[str, Request], size: int,
                   joined: Sequence[int]) -> list[Waiting]:
    """Every rank's pending requests, oldest first.

    ``have`` and ``missing`` are ranks of the set; joined ranks are never missing a request
    other than a join (they take part in those with zeros).  Collective over ``comm``.
    """
    now = time.monotonic()
    mine = [(name, now - r.submitted_at, int(r.kind)) for name, r in pending.items()]
    have: dict[str, set[int]] = {}
    age: dict[str, float] = {}
    kinds: dict[str, Kind] = {}
    for rank, items in enumerate(comm.allgather(mine)):
        for name, waited, kind in items:
            have.setdefault(name, set()).add(rank)
            age[name] = max(age.get(name, 0.0), waited)
            kinds[name] = Kind(kind)
    everyone = set(range(size))
    joined_set = set(joined)
    out = []
    for name in sorted(have, key=lambda n: (-age[n], n)):
        excused = set() if kinds[name] == Kind.JOIN else joined_set
        missing = sorted(everyone - have[name] - excused)
        out.append(Waiting(name, kinds[name], age[name], sorted(have[name]), missing))
    return out


class StallInspector:
    """When to look for stalls, when to give up, and the warnings (rank 0 writes them)."""

    def __init__(self, rank: int, warn_s: float, shutdown_s: float, disabled: bool,
                 deadlock_s: float) -> None:
        self.rank = rank
        self.warn_s = warn_s
        self.shutdown_s = shutdown_s
        self.disabled = disabled or warn_s <= 0
        self.deadlock_s = deadlock_s
        self.last_check = time.monotonic()

    @classmethod
    def for_config(cls, rank: int, config: Config) -> StallInspector:
        """The inspector with the configured limits (``MPITRAIN_STALL_*``, deadlock time)."""
        return cls(rank, config.stall_check_time_seconds, config.stall_shutdown_time_seconds,
                   config.stall_check_disable, config.deadlock_time_seconds)

    @property
    def slow_round_after(self) -> float:
        """Seconds a negotiation round may wait before it is reported (0: never)."""
        return self.warn_s if not self.disabled else 0.0

    def due(self, pending: Mapping[str, Request]) -> bool:
        """Whether this rank should ask for an inspection in this round's header."""
        if self.disabled or not pending:
            return False
        now = time.monotonic()
        if now - self.last_check < self.warn_s:
            return False
        oldest = min(r.submitted_at for r in pending.values())
        return now - oldest >= self.warn_s

    def warn(self, waiting: Sequence[Waiting],
             world_ranks: Sequence[int]) -> list[tuple[str, list[int], float]]:
        """Report requests some ranks have not submitted for too long.

        Returns:
            (name, missing world ranks, age) of those waiting past the shutdown time.
        """
        lines = []
        overdue = []
        for name, kind, age, _, missing in waiting:
            if not missing or age < self.warn_s:
                continue
            missing_world = [world_ranks[r] for r in missing]
            lines.append(f"  {kind.label} '{name}' waited {age:.0f} s; "
                         f"missing ranks: {missing_world}")
            if self.shutdown_s > 0 and age >= self.shutdown_s:
                overdue.append((name, missing_world, age))
        if lines and self.rank == 0:
            sys.stderr.write(
                "mpitrain: stall: some ranks submitted tensors that others have not for more "
                f"than {self.warn_s:.0f} s.  Different ranks may be submitting different "
                "tensors, or only some ranks are submitting; that deadlocks.\n"
                + "\n".join(lines) + "\n")
            sys.stderr.flush()
        return overdue

    def deadlock_message(self, waiting: Sequence[Waiting], world_ranks: Sequence[int]) -> str:
        """The error every pending request fails with when every rank is stuck."""
        lines = []
        for name, kind, age, have, missing in waiting:
            have_world = [world_ranks[r] for r in have]
            missing_world = [world_ranks[r] for r in missing]
            lines.append(f"  {kind.label} '{name}' (waiting {age:.0f} s): submitted by ranks "
                         f"{have_world}, never by ranks {missing_world}")
        return ("deadlock: every rank is waiting for a collective that can never run "
                f"(nothing was submitted or completed on any rank for {self.deadlock_s:g} s"
                "; MPITRAIN_DEADLOCK_TIME_SECONDS).  Pending requests:\n"
                + "\n".join(lines) + "\nEvery rank must submit the same collectives in "
                "the same order; give collectives explicit names (name=...) when the "
                "ranks' code paths differ.")

    def report_slow_round(self, waited: float) -> None:
        """Say that a negotiation round has waited ``waited`` s for the other ranks."""
        if self.rank == 0:
            sys.stderr.write(f"mpitrain: stall: negotiation has waited {waited:.0f} s for other "
                             "ranks to reach the engine; a rank may be hung or busy outside "
                             "Python for that long.\n")
            sys.stderr.flush()
