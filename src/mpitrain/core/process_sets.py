"""Process sets: collectives among a subset of ranks, with Horovod's API.

``global_process_set`` (id 0) is every rank.  Other sets are registered collectively, by every
rank in the same order, at init (``init(process_sets=[...])``) or later with
:func:`mpitrain.session.add_process_set`; :func:`mpitrain.session.remove_process_set` retires
one.  This module is ground floor: the set objects and the registry of ids the engine gave
them; registering is the session's business, because the engine negotiates it.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from . import runtime


class ProcessSet:
    """A set of world ranks that can run collectives among themselves.

    Args:
        ranks_or_comm: world ranks, or an mpi4py communicator whose members form the set.

    Raises:
        ValueError: ``ranks_or_comm`` is neither (as in Horovod), or repeats a rank.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        self.process_set_id: int | None = None
        self._comm = None
        if hasattr(ranks_or_comm, "Get_group"):
            self._comm = ranks_or_comm
            self.ranks: list[int] = []
        else:
            given: list[Any] = (list(ranks_or_comm) if isinstance(ranks_or_comm, Iterable)
                                else [None])
            if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) for r in given):
                raise ValueError(f"ProcessSet takes a list of integer ranks or an mpi4py "
                                 f"communicator, got {ranks_or_comm!r}")
            ranks = [int(r) for r in given]
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
            self.ranks = sorted(ranks)

    def resolve_ranks(self) -> list[int]:
        """Ranks of a set made from a communicator, as ranks of the job (collective on it)."""
        if self._comm is not None and not self.ranks:
            state = runtime.state()
            world_group = state.comms.world.Get_group()
            group = self._comm.Get_group()
            self.ranks = sorted(group.Translate_ranks(list(range(group.Get_size())),
                                                      world_group))
            group.Free()
            world_group.Free()
        return self.ranks

    @property
    def mpi_comm(self) -> Any:
        """The mpi4py communicator this set was made from, or None (made from ranks)."""
        return self._comm

    def size(self) -> int | None:
        """Number of ranks in the set, or None before it is registered."""
        return len(self.ranks) if self.process_set_id is not None else None

    def rank(self) -> int | None:
        """This process's rank within the set (None if not a member or not registered)."""
        if self.process_set_id is None:
            return None
        me = runtime.rank()
        return self.ranks.index(me) if me in self.ranks else None

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None before registration)."""
        if self.process_set_id is None:
            return None
        return runtime.rank() in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def set_id_of(process_set: ProcessSet | None) -> int:
    """The registered id of ``process_set`` (the global set for None).

    Raises:
        TypeError: not a ProcessSet.
        ValueError: not registered.
    """
    if process_set is None:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered; call add_process_set first")
    return process_set.process_set_id


def size_of(process_set: ProcessSet | None) -> int:
    """Number of ranks in a registered ``process_set`` (the job for None): what adapters ask
    when they scale by the set's size.  Raises like :func:`set_id_of`."""
    ps = global_process_set if process_set is None else process_set
    set_id_of(ps)
    return len(ps.ranks)


def rank_in(process_set: ProcessSet | None) -> int:
    """This process's rank within a registered ``process_set`` it belongs to.

    Raises:
        ValueError: not registered, or this process is not a member.
    """
    ps = global_process_set if process_set is None else process_set
    set_id_of(ps)
    me = runtime.rank()
    if me not in ps.ranks:
        raise ValueError(f"rank {me} is not a member of {ps!r}")
    return ps.ranks.index(me)


class Registry:
    """The sets registered now (besides the global one), by the id the engine gave them."""

    def __init__(self) -> None:
        self._sets: dict[int, ProcessSet] = {}

    def remember(self, process_set: ProcessSet, set_id: int, ranks: list[int]) -> None:
        process_set.process_set_id = set_id
        process_set.ranks = ranks
        self._sets[set_id] = process_set

    def forget(self, process_set: ProcessSet) -> None:
        if process_set.process_set_id is not None:
            self._sets.pop(process_set.process_set_id, None)
        process_set.process_set_id = None

    def forget_all(self) -> None:
        for ps in self._sets.values():
            ps.process_set_id = None
        self._sets.clear()

    def get(self, set_id: int) -> ProcessSet:
        """The set registered under ``set_id`` (0: the global set).

        Raises:
            ValueError: no set has that id.
        """
        if set_id == 0:
            return global_process_set
        if set_id not in self._sets:
            raise ValueError(f"no process set is registered with id {set_id}")
        return self._sets[set_id]

    def in_order(self) -> list[ProcessSet]:
        return [self._sets[i] for i in sorted(self._sets)]


registry = Registry()


def registered_process_sets() -> list[ProcessSet]:
    """The process sets registered now (besides the global one), in registration order."""
    return registry.in_order()


__all__ = ["ProcessSet", "Registry", "global_process_set", "rank_in", "registered_process_sets",
           "registry", "set_id_of", "size_of"]
