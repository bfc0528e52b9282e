"""A process set as the data plane sees it: communicators, node layout, reusable buffers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from ..core.config import Config
from ..core.memory import page_aligned_empty
from ..core.topology import Communicators, Topology
from .scratch import Scratch
from .shm import Node


@dataclass
class Group:
    """Everything an algorithm needs to run a collective among one set of ranks.

    ``comms.world`` is private to the data plane of this set (no other traffic on it), so
    collectives issued here never match messages of the engine's negotiation.
    """

    comms: Communicators
    topology: Topology
    config: Config
    _buffers: Scratch = field(default_factory=lambda: Scratch(page_aligned_empty))
    _state: dict[str, Any] = field(default_factory=dict)

    @property
    def comm(self) -> Any:
        return self.comms.world

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def size(self) -> int:
        return self.topology.size

    def scratch(self, key: str, nbytes: int) -> np.ndarray:
        """Return a reusable byte buffer of at least ``nbytes`` (grown, never shrunk)."""
        return self._buffers.get(key, nbytes)

    def shared_empty(self, nbytes: int) -> np.ndarray:
        """A new byte buffer that the data plane reduces from fastest.

        Adapters allocate long-lived gradient buckets here so that an in-place allreduce on
        them needs no copy into a fusion buffer.  Callable from any thread; it never
        communicates (it is not collective).  Peers on the node read it in place with
        cross-memory attach (:mod:`mpitrain.ops.cma`), so it needs no shared segment; large
        buckets get huge pages so that first touch and the kernel's page walks stay cheap.
        """
        return page_aligned_empty(nbytes)

    # ----------------------------------------------------------- algorithm state (lazy)
    def node(self) -> Node:
        """This node's shared-memory state (:class:`mpitrain.ops.shm.Node`).

        Collective over the group the first time (every rank calls it at the same
        collective).  ``node().cma`` (peers read each other's memory directly) is agreed
        across all nodes so every rank picks the same algorithm.
        """
        if "node" not in self._state:
            # One node: use the group's own communicator so node ranks are group ranks.
            one_node = self.topology.num_nodes == 1
            node = Node(self.comms.world if one_node else self.comms.local)
            node.cma = self.comm.allreduce(1 if node.probed else 0, op=MPI.MIN) == 1
            self._state["node"] = node
        return self._state["node"]

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """Algorithm state made once per group by ``make()`` (e.g. derived communicators).

        Collective when ``make`` communicates: every rank first asks at the same collective.
        The state is closed with the group when it has a ``close()`` method.
        """
        key = "memo." + key
        value = self._state.get(key)
        if value is None:
            value = self._state[key] = make()
        return value

    def workspace(self, key: str = "ring") -> Any:
        """Reusable scratch of the ring algorithm for one of this group's communicators."""
        ws = self._state.get("ws." + key)
        if ws is None:
            ws = self._state["ws." + key] = Scratch()
        return ws

    def channels(self, n: int) -> list[Group]:
        """This group and n-1 others like it on duplicated communicators (collective once).

        Each channel has its own communicators, shared-memory state and scratch, so parts
        of one bucket can be reduced concurrently without their messages meeting.
        """
        chans: list[Group] = self._state.setdefault("channels", [self])
        while len(chans) < n:
            c = self.comms
            dup = Communicators(world=c.world.Dup(), local=c.local.Dup(), cross=c.cross.Dup(),
                                machine=c.machine.Dup())
            chans.append(Group(dup, self.topology,
                               dataclasses.replace(self.config, allreduce_streams=1)))
        return chans[:n]

    def pool(self, workers: int) -> ThreadPoolExecutor:
        """Threads that drive channels 1..n-1 (channel 0 runs on the calling thread)."""
        pool = self._state.get("pool")
        if pool is None or pool._max_workers < workers:
            if pool is not None:
                pool.shutdown()
            pool = self._state["pool"] = ThreadPoolExecutor(workers, "mpitrain-channel")
        return pool

    def fusion_buffer(self, nbytes: int) -> np.ndarray:
        """The byte buffer fused buckets are packed into."""
        return self.scratch("fusion", nbytes)

    def communicators(self) -> list[Any]:
        """Every communicator this group and its channels talk on (to revoke them all)."""
        groups: list[Group] = self._state.get("channels", [self])
        return [comm for g in groups for comm in (g.comms.world, g.comms.local, g.comms.cross,
                                                  g.comms.machine)]

    def close(self) -> None:
        pool = self._state.pop("pool", None)
        if pool is not None:
            pool.shutdown()
        for chan in self._state.pop("channels", [])[1:]:
            chan.close()
        node = self._state.get("node")
        if node is not None:
            node.close()
        for key, value in self._state.items():
            if key.startswith("memo.") and hasattr(value, "close"):
                value.close()
        self._state.clear()
        self._buffers.clear()
        self.comms.free()
