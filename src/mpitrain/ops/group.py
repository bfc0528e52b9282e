"""A process set as the data plane sees it: communicators, node layout, reusable buffers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import Config
from ..topology import Communicators, Topology


@dataclass
class Group:
    """Everything an algorithm needs to run a collective among one set of ranks.

    ``comms.world`` is private to the data plane of this set (no other traffic on it), so
    collectives issued here never match messages of the engine's negotiation.
    """

    comms: Communicators
    topology: Topology
    config: Config
    _buffers: dict[str, np.ndarray] = field(default_factory=dict)

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
        buf = self._buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._buffers[key] = buf
        return buf[:nbytes]

    def shared_empty(self, nbytes: int) -> np.ndarray:
        """A new byte buffer that the data plane reduces from fastest (e.g. shared memory).

        Adapters allocate long-lived gradient buckets here so that an in-place allreduce on
        them needs no copy into a fusion buffer.  Callable from any thread; it never
        communicates (it is not collective).  This base version is plain process memory.
        """
        return np.empty(max(nbytes, 1), dtype=np.uint8)[:nbytes]

    def fusion_buffer(self, nbytes: int) -> np.ndarray:
        """The byte buffer fused buckets are packed into."""
        return self.scratch("fusion", nbytes)

    def close(self) -> None:
        self._buffers.clear()
        self.comms.free()
