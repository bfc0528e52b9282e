"""Process sets: collectives among a subset of ranks, with Horovod's API.

``global_process_set`` (id 0) is every rank.  Other sets are registered collectively, by every
rank in the same order, at init (``init(process_sets=[...])``) or later with
:func:`add_process_set`; :func:`remove_process_set` retires one.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from . import runtime
from .engine.request import Kind, Request


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

    def _resolve_ranks(self) -> list[int]:
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


def _set_of(process_set: ProcessSet | None) -> int:
    """The registered id of ``process_set`` (the global set for None)."""
    if process_set is None:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set!r} is not registered; call add_process_set first")
    return process_set.process_set_id


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank must call this, in the same order.

    Returns:
        The registered ProcessSet (the one passed in, now with an id).

    Raises:
        ValueError: the ranks are out of range, or the set is already registered.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    state = runtime.state()
    ranks = ps._resolve_ranks()
    size = state.topology.size
    bad = [r for r in ranks if not 0 <= r < size]
    if bad or not ranks:
        raise ValueError(f"process set ranks {ranks} must be non-empty and within 0..{size - 1}")
    engine = state.engine
    request = Request(name=engine.next_name(0, Kind.ADD_SET), kind=Kind.ADD_SET, entries=[],
                      payload=tuple(ranks))
    ps.process_set_id = engine.submit(request).wait()
    ps.ranks = ranks
    _registered[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Retire a process set; every rank must call this, in the same order.

    Returns:
        True once removed; False when it was not registered.

    Raises:
        ValueError: an attempt to remove the global process set.
    """
    set_id = process_set.process_set_id
    if set_id == 0:
        raise ValueError("the global process set cannot be removed")
    if set_id is None:
        return False
    engine = runtime.state().engine
    request = Request(name=engine.next_name(0, Kind.REMOVE_SET), kind=Kind.REMOVE_SET,
                      entries=[], payload=set_id)
    try:
        engine.submit(request).wait()
    except ValueError:
        return False
    process_set.process_set_id = None
    _registered.pop(set_id, None)
    return True


_registered: dict[int, ProcessSet] = {}


def registered_process_sets() -> list[ProcessSet]:
    """The process sets registered now (besides the global one), in registration order."""
    return [_registered[i] for i in sorted(_registered)]


def on_init(process_sets: Sequence[ProcessSet] | str | None) -> None:
    """Register the sets passed to init() (called by runtime.init)."""
    global_process_set.ranks = list(range(runtime.size()))
    if process_sets is None or isinstance(process_sets, str):
        if isinstance(process_sets, str) and process_sets != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet "
                             "objects or 'dynamic'")
        return
    for ps in process_sets:
        add_process_set(ps)


def on_shutdown() -> None:
    """Forget registrations: ids are meaningless after the engine stops."""
    for ps in _registered.values():
        ps.process_set_id = None
    _registered.clear()
