"""The process sets the engine runs on this rank: each set's state by id, the names in flight
in each, the counters that name unnamed requests, and adding or removing a set.

Separate from :mod:`.engine`, which runs the cycles: this is the engine's bookkeeping of sets,
the same for the global set opened at start and for every set added later.  (The
:class:`~mpitrain.core.process_sets.ProcessSet` objects users hold, and their ids, are
:mod:`mpitrain.core.process_sets`'s; this registry keeps what the engine needs to run each one.)

Adding a set is collective over the whole job: the engine adds it when the global set's round
decides the request, at the same point of the global order on every rank, and the global
set's communicator is split (``MPI_Comm_split``) into the new set's members.  A rank outside
the set keeps a state without communicators, so that set ids stay aligned across ranks.

The registry shares the engine's lock: a submission checks its set and the names in flight
there under the same lock that guards the engine's queue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from .. import ops
from ..core import topology
from ..core.config import Config
from .autotune import Setting
from .mpi_wait import wait_for
from .negotiation import Response
from .request import Kind, Request, generated_name
from .set_state import SetState
from .timeline import Timeline

GLOBAL_SET_ID = 0


class SetRegistry:
    """The engine's process sets on this rank (see the module).

    ``states`` and ``inflight`` are read and changed under the engine's lock, which the
    registry's own methods take themselves where they need it.
    """

    def __init__(self, lock: threading.Condition, config: Config, timeline: Timeline,
                 topo: topology.Topology, fusion_threshold: Callable[[], int]) -> None:
        self._lock = lock
        # Guards the unnamed-request counters on their own, held by align_names across its
        # exchange (see there); not the engine's lock, so submissions go on meanwhile.
        self._names = threading.Lock()
        self._config = config
        self._fusion_threshold = fusion_threshold
        self._timeline = timeline
        self._topology = topo
        self.states: dict[int, SetState] = {}
        self.inflight: dict[int, set[str]] = {}
        self._next_id = 1

    def open(self, set_id: int, world_ranks: list[int], comms: topology.Communicators | None,
             topo: topology.Topology | None, setting: Setting | None,
             extra_words: int = 0) -> SetState:
        """Open set ``set_id`` (see :meth:`.SetState.open`) and register it.

        ``setting``: autotune's current setting, applied to a set added after a tuned change.
        """
        group = None
        if comms is not None:
            assert topo is not None
            group = ops.Group(comms, topo, self._config)
        state = SetState.open(set_id, world_ranks, group, self._timeline,
                              self._fusion_threshold, extra_words)
        if state.executor is not None and setting is not None:
            state.apply(setting)
        with self._lock:
            self.states[set_id] = state
            self.inflight.setdefault(set_id, set())
        return state

    def get(self, set_id: int) -> SetState:
        state = self.states.get(set_id)
        if state is None:
            raise ValueError(f"process set {set_id} is not registered (removed, or never added)")
        return state

    def ids(self) -> list[int]:
        return sorted(self.states)

    def control(self, resp: Response, setting: Setting | None,
                fail: Callable[[list[Request], str], None]) -> None:
        """Add or remove a process set, at the same point of the global order everywhere.

        ``setting``: autotune's current one, for a set added; ``fail``: how the engine fails
        the requests still pending in a set removed.
        """
        assert resp.request is not None or resp.error is not None
        payload = resp.meta.payload
        if resp.kind == Kind.ADD_SET:
            set_id = self._add(list(payload), setting)
            if resp.request is not None and resp.request.handle is not None:
                resp.request.handle.result = set_id
            return
        set_id = int(payload)
        with self._lock:
            state = self.states.pop(set_id, None)
            names = self.inflight.pop(set_id, set())
        if state is None:
            if resp.request is not None and resp.request.handle is not None:
                resp.request.handle.fail(ValueError(f"process set {set_id} is not registered"))
            return
        if state.negotiator is not None:
            fail(state.negotiator.drop_all(), f"process set {set_id} was removed")
        with self._lock:
            names.clear()
        state.close()
        if resp.request is not None and resp.request.handle is not None:
            resp.request.handle.result = True

    def _add(self, ranks: list[int], setting: Setting | None) -> int:
        """Add the set of world ``ranks`` and return its id.

        Collective over the whole job (the global set's communicator is split).
        """
        set_id = self._next_id
        self._next_id += 1
        world = self.states[GLOBAL_SET_ID].group
        assert world is not None
        member = self._topology.rank in ranks
        sub = world.comm.Split(0 if member else MPI.UNDEFINED, key=ranks.index(
            self._topology.rank) if member else 0)
        if member:
            topo, comms = topology.build_subset(sub, self._topology, ranks)
            self.open(set_id, ranks, comms, topo, setting)
        else:
            self.open(set_id, ranks, None, None, setting)
        return set_id

    # ------------------------------------------------------------------ unnamed requests
    def next_name(self, set_id: int, kind: Kind) -> str:
        """A name for an unnamed request: identical programs produce identical names."""
        state = self.get(set_id)
        with self._names:
            n = state.name_counters.get(kind, 0)
            state.name_counters[kind] = n + 1
        return generated_name(kind, n, set_id)

    def align_names(self, state: SetState, only_if_quiet: bool = False) -> None:
        """Give every rank the same unnamed-request counters once a join has completed (or
        requests were given up on: see the engine's ``_cycle``).

        While some ranks were joined, the others went on submitting (allreduces that ran with
        zeros from the joined ranks, or requests refused because of the join), so their
        counters moved and the joined ranks' did not.  Every rank is inside join() now, so no
        unnamed request is being named: take the largest count of each kind everywhere, and
        the next unnamed collective has the same name on every rank again.

        The counters stay locked from the read to the write.  The exchange can release another
        rank (its failed request completes once its own exchange is done), which can then meet
        this rank's program in a collective of the user's own and let it go on to its next
        unnamed call while this thread still holds the old counts: that name must wait for the
        aligned count rather than be drawn from the old one and then overwritten (the same
        name twice here, one ahead on the other ranks from then on).
        """
        assert state.negotiator is not None
        kinds = list(Kind)
        with self._names:
            counts = np.array([state.name_counters.get(k, 0) for k in kinds]
                              + [len(state.negotiator.pending)], dtype=np.int64)
            wait_for(state.negotiator.comm.Iallreduce(MPI.IN_PLACE, counts, op=MPI.MAX))
            if only_if_quiet and counts[-1] > 0:
                return  # some rank still waits for its peers' calls: their numbers still count
            for kind, count in zip(kinds, counts[:-1].tolist()):
                state.name_counters[kind] = count


__all__ = ["GLOBAL_SET_ID", "SetRegistry"]
