"""CUDA IPC within a node: ranks reduce straight from each other's device buffers.

The shared-memory algorithm of the CPU data plane, on the device:

* every local rank owns a **window**, a device allocation made with plain ``cudaMalloc`` (a
  pool's sub-allocation cannot be exported), whose ``cudaIpcGetMemHandle`` handle is
  all-gathered once on the local communicator; every rank opens every peer's handle once
  (``cudaIpcOpenMemHandle``) and keeps it open while the window lives;
* an allreduce packs the bucket into the window, then **reduce-scatter**: rank r reduces
  slice r of all windows (rank order, so every rank's result has the same bits) into slice r
  of its own window; then **allgather**: every rank copies slice s from window s.  A local
  barrier after the device work of each phase makes the peers' bytes complete (each rank waits
  for its stream first); a third barrier keeps a fast rank from refilling its window while a
  slow one still copies from it;
* the hierarchical allreduce runs the two phases around an allreduce of slice r across nodes.

Windows grow collectively: bucket sizes are negotiated, so every local rank asks for the same
size at the same point and all re-export together.

The device operations go through :class:`IpcRuntime` and :class:`DeviceOps` so the tests run
the exact protocol with ranks as threads over numpy memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...core.dtypes import STORAGE
from ..reduction import Reduction
from ..slices import balanced as owner_slices

MIN_WINDOW_BYTES = 1 << 20  # the first window; later ones at least double
_MAX_CACHED_VIEWS = 4096  # (dtype, range) pairs kept; a few per channel and layout in practice


class IpcRuntime(Protocol):
    """Device memory that other processes can open (cupy's runtime on a GPU)."""

    def allocate(self, nbytes: int) -> Any: ...

    def handle(self, memory: Any) -> bytes: ...

    def open(self, handle: bytes, nbytes: int) -> Any: ...

    def close(self, opened: Any) -> None: ...

    def free(self, memory: Any) -> None: ...

    def view(self, memory: Any, dtype: np.dtype, offset: int, count: int) -> Any:
        """A flat array of ``count`` elements at ``offset`` bytes into ``memory``."""


class DeviceOps(Protocol):
    """The device work of the phases, enqueued on one stream."""

    def reduce(self, inputs: list[Any], out: Any, how: Reduction) -> None: ...

    def copy(self, dst: Any, src: Any) -> None: ...

    def synchronize(self) -> None:
        """Wait until the stream's work is done (before telling peers it is)."""


@dataclass
class Window:
    """This rank's exported device buffer and every local peer's, opened."""

    runtime: IpcRuntime
    comm: Any  # the local communicator (one per channel)
    capacity: int = 0
    own: Any = None
    peers: list[Any] = field(default_factory=list)  # index = local rank; own at own index
    exchanges: int = 0
    # Views of the windows by (dtype, lo, hi): a bucket layout repeats every step, and making
    # a device array view is a few microseconds of Python each (p of them per phase).
    _views: dict[tuple[str, int, int], list[Any]] = field(default_factory=dict, repr=False)

    @property
    def rank(self) -> int:
        return int(self.comm.Get_rank())

    @property
    def size(self) -> int:
        return int(self.comm.Get_size())

    def ensure(self, nbytes: int) -> None:
        """Make every window hold ``nbytes``; collective over the local communicator.

        Every local rank must call this with the same ``nbytes`` (negotiated bucket sizes
        guarantee it); a rank asking for another size is a bug reported on every rank.
        """
        if nbytes <= self.capacity:
            return
        capacity = max(nbytes, 2 * self.capacity, MIN_WINDOW_BYTES)
        self._release(barrier=self.own is not None)
        self.own = self.runtime.allocate(capacity)
        mine = (self.runtime.handle(self.own), capacity, nbytes)
        gathered = self.comm.allgather(mine)
        asked = {g[2] for g in gathered}
        if len(asked) != 1:
            raise RuntimeError(f"local ranks asked for IPC windows of different sizes {asked}; "
                               "buckets must be identical on every rank")
        self.peers = [self.own if r == self.rank else self.runtime.open(h, cap)
                      for r, (h, cap, _) in enumerate(gathered)]
        self.capacity = capacity
        self.exchanges += 1

    def views(self, dtype: str, lo: int, hi: int) -> list[Any]:
        """Every rank's window slice [lo, hi) (elements of ``dtype``), in local-rank order."""
        key = (dtype, lo, hi)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            storage = STORAGE[dtype]
            found = self._views[key] = [
                self.runtime.view(m, storage, lo * storage.itemsize, hi - lo)
                for m in self.peers]
        return found

    def _release(self, barrier: bool) -> None:
        self._views.clear()  # they view the memory released below
        for r, memory in enumerate(self.peers):
            if r != self.rank:
                self.runtime.close(memory)
        self.peers = []
        if barrier:
            self.comm.Barrier()  # every peer has closed its mapping of our window
        if self.own is not None:
            self.runtime.free(self.own)
            self.own = None
        self.capacity = 0

    def close(self, collective: bool = True) -> None:
        """Close peers' handles and free this window.

        Collective by default (peers must stop using it first); at shutdown, when every rank is
        tearing down anyway and a dead peer must not hang the others, ``collective=False``.
        """
        self._release(barrier=collective and self.own is not None)


@dataclass(frozen=True)
class Part:
    """The window elements [lo, hi) one channel reduces, the alignment of the slices the
    ranks own in it, and the channel's local communicator (None: the window's): channels
    work on disjoint ranges of one window and synchronise among themselves only."""

    lo: int
    hi: int
    align: int = 1
    comm: Any = None

    def owners(self, ranks: int) -> list[tuple[int, int]]:
        """Each rank's slice of the part, relative to ``lo``."""
        return owner_slices(self.hi - self.lo, ranks, self.align)


def reduce_scatter_phase(window: Window, ops: DeviceOps, how: Reduction,
                         part: Part) -> tuple[int, int]:
    """Reduce this rank's slice of the part from every window into its own window.

    The caller has enqueued this rank's data into its window [lo, hi) on ``ops``' stream.
    Returns the (start, stop) this rank owns, absolute.
    """
    comm = window.comm if part.comm is None else part.comm
    lo = part.lo
    ops.synchronize()
    comm.Barrier()  # every window holds its rank's data
    start, stop = part.owners(window.size)[window.rank]
    if stop > start:
        inputs = window.views(how.dtype, lo + start, lo + stop)
        ops.reduce(inputs, inputs[window.rank], how)
    ops.synchronize()
    comm.Barrier()  # every slice is reduced
    return lo + start, lo + stop


def allgather_phase(window: Window, ops: DeviceOps, dtype: str, part: Part,
                    out: Callable[[int, int], Any]) -> None:
    """Copy every rank's reduced slice of the part into ``out(start, stop)``.

    ``out(start, stop)`` returns the destination for elements [start, stop) (absolute): the
    caller's output buffer, or the window itself before an unpack.
    """
    comm = window.comm if part.comm is None else part.comm
    lo = part.lo
    for r, (start, stop) in enumerate(part.owners(window.size)):
        if stop > start:
            src = window.views(dtype, lo + start, lo + stop)[r]
            ops.copy(out(lo + start, lo + stop), src)
    ops.synchronize()
    comm.Barrier()  # nobody refills its window while a peer still copies from it


def allreduce(window: Window, ops: DeviceOps, how: Reduction, part: Part,
              out: Callable[[int, int], Any],
              cross: Callable[[int, int], None] | None = None) -> None:
    """Allreduce the part's window elements across the node (and across nodes via ``cross``).

    Args:
        cross: for the hierarchical allreduce, allreduces this rank's reduced slice (absolute
            element range) across nodes, in place in the window; prescale applies within the
            node and postscale after the cross-node step.
    """
    comm = window.comm if part.comm is None else part.comm
    start, stop = reduce_scatter_phase(window, ops, how if cross is None else how.prescale_only(),
                                       part)
    if cross is not None:
        cross(start, stop)
        if how.postscale != 1.0 and stop > start:
            mine = window.views(how.dtype, start, stop)[window.rank]
            ops.reduce([mine], mine, Reduction(how.dtype, postscale=how.postscale))
        ops.synchronize()
        comm.Barrier()
    allgather_phase(window, ops, how.dtype, part, out)


class CupyIpc:
    """:class:`IpcRuntime` over cupy's CUDA runtime bindings."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def allocate(self, nbytes: int) -> Any:
        return self.cupy.cuda.Memory(nbytes)  # cudaMalloc, never a pool sub-allocation

    def handle(self, memory: Any) -> bytes:
        return bytes(self.cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))

    def open(self, handle: bytes, nbytes: int) -> Any:
        runtime = self.cupy.cuda.runtime
        ptr = runtime.ipcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess)
        return self.cupy.cuda.UnownedMemory(ptr, nbytes, None)

    def close(self, opened: Any) -> None:
        self.cupy.cuda.runtime.ipcCloseMemHandle(opened.ptr)

    def free(self, memory: Any) -> None:
        # cupy frees a Memory when its last reference goes; the Window drops its reference.
        del memory

    def view(self, memory: Any, dtype: np.dtype, offset: int, count: int) -> Any:
        pointer = self.cupy.cuda.MemoryPointer(memory, offset)
        return self.cupy.ndarray((count,), dtype=dtype, memptr=pointer)
