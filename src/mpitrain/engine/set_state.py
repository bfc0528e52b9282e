"""What the engine keeps for one process set on this rank, and how it is opened and closed.

Separate from :mod:`.engine`, which runs the cycles: a set's state is its own small life
(communicator group, negotiator, executor, the counters that name unnamed requests), built the
same way for the global set at start and for every set added later, and torn down the same
way when a set is removed or the engine stops.  A rank outside a set keeps a state without
any of these, so that set ids stay aligned across ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import ops
from ..core import survivors
from .autotune import Setting
from .executor import Executor
from .negotiation import Negotiator
from .request import Kind
from .timeline import Timeline


@dataclass(eq=False)
class SetState:
    """One process set as the engine sees it on this rank."""

    id: int
    world_ranks: list[int]
    member: bool
    group: ops.Group | None = None
    negotiator: Negotiator | None = None
    executor: Executor | None = None
    name_counters: dict[Kind, int] = field(default_factory=dict)

    @classmethod
    def open(cls, set_id: int, world_ranks: list[int], group: ops.Group | None,
             timeline: Timeline, fusion_threshold: Callable[[], int],
             extra_words: int = 0) -> SetState:
        """The state of set ``set_id`` over ``group`` (its communicators, topology and
        configuration), None where this rank is not a member.

        Collective over the set's members (the negotiator duplicates its communicator).
        ``fusion_threshold``: the engine's current threshold (every set fuses at the same one).
        ``extra_words``: words every header of this set carries for the engine (autotune).
        """
        state = cls(set_id, world_ranks, group is not None)
        if group is not None:
            state.group = group
            state.negotiator = Negotiator(group.comms.world.Dup(), world_ranks, group.config,
                                          extra_words)
            state.executor = Executor(group, timeline, fusion_threshold)
        return state

    @property
    def rank(self) -> int:
        assert self.group is not None
        return self.group.rank

    def communicators(self) -> list[Any]:
        """Every communicator of this set on this rank (none where it is not a member)."""
        comms = self.group.communicators() if self.group is not None else []
        if self.negotiator is not None:
            comms.append(self.negotiator.comm)
        return comms

    def apply(self, setting: Setting) -> None:
        """Run this set's executor with autotune's ``setting`` (nothing where not a member).

        The fusion threshold is not the set's: the executor reads the engine's, the one
        gradient buckets are planned at too.
        """
        if self.executor is not None:
            self.executor.overrides = ops.Overrides(setting.algorithm, setting.channels)

    def close(self) -> None:
        if self.executor is not None:
            with contextlib.suppress(Exception):  # teardown is best effort
                self.executor.close()
        if self.negotiator is not None:
            survivors.release(self.negotiator.comm)
        if self.group is not None:
            self.group.close()
