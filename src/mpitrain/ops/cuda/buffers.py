"""The memory a :class:`~.allreduce.DeviceGroup` keeps from bucket to bucket.

The fusion buffer (or views of the CUDA IPC window, when the node shares one), device scratch
by name, pinned host buffers for staging, host scratch for the rank-order fold, and each
layout's pack tables.  Separate from :mod:`.allreduce` (what one bucket does) because all of
it follows one rule: made once, reused by every bucket of its size or layout, grown and never
shrunk, and replaced only when the device is idle (see :meth:`DeviceBuffers.idle`).  That is
what keeps the device work of a bucket at a fixed count with no allocation in the steady state
(``tests/mpi/test_device_budget.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..scratch import Scratch
from .ipc import Window
from .pack import Packer


def addressed(arrays: Sequence[Any]) -> tuple[Sequence[Any], tuple[int, ...]]:
    """Arrays with their device addresses, as :meth:`DeviceBuffers.packer` takes them."""
    return arrays, tuple([int(a.data.ptr) for a in arrays])


class DeviceBuffers:
    """The buffers one DeviceGroup reuses (see the module); ``window`` is its IPC window, if
    the node shares one."""

    def __init__(self, cupy: Any, cupyx: Any, window: Window | None) -> None:
        self.cupy = cupy
        self.cupyx = cupyx
        self.window = window
        self._fusion: Any = None
        self._fused_views: dict[tuple[int, str], Any] = {}
        self._packers: dict[tuple[Any, ...], Packer] = {}
        self._scratch: dict[tuple[int | str, str], Any] = {}
        self._host_scratch: dict[int, Scratch] = {}
        self._pinned: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def idle(self) -> None:
        """Wait until this device has no work pending, before a cached buffer is replaced.

        The buffers here are used on the channels' streams, but allocated and freed on this
        thread's (cupy's pool hands freed memory to the next allocation on the freeing
        thread's stream at once, and CUDA IPC peers map the window): replacing one while a
        kernel or copy still uses it would hand that memory to someone else underneath it.
        Buffers only grow, so this happens a few times per job.
        """
        self.cupy.cuda.runtime.deviceSynchronize()

    def fusion(self, nbytes: int, storage: np.dtype) -> Any:
        """The fusion buffer's first ``nbytes`` as ``storage`` elements (the IPC window when
        the node shares one); one view per size, made once while the buffer lives."""
        if self.window is not None:
            if nbytes > self.window.capacity:
                self.idle()
            exchanges = self.window.exchanges
            self.window.ensure(nbytes)
            if self.window.exchanges != exchanges:
                self._fused_views.clear()  # views of the window that was just replaced
        elif self._fusion is None or self._fusion.nbytes < nbytes:
            self.idle()
            self._fusion = self.cupy.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            self._fused_views.clear()
        key = (nbytes, storage.str)
        view = self._fused_views.get(key)
        if view is None:
            if len(self._fused_views) > 256:  # sizes change (new layouts): keep it small
                self._fused_views.clear()
            if self.window is not None:
                whole = self.window.runtime.view(self.window.own, np.dtype(np.uint8), 0, nbytes)
            else:
                whole = self._fusion[:nbytes]
            view = self._fused_views[key] = whole.view(storage)
        return view

    def scratch(self, name: int | str, dtype: np.dtype, count: int) -> Any:
        """Device scratch under ``name`` (a channel's index, or a purpose), grown, never shrunk."""
        key = (name, dtype.str)
        with self._lock:
            buf = self._scratch.get(key)
            if buf is None or buf.size < count:
                if buf is not None:
                    self.idle()
                buf = self.cupy.empty(max(count, 1 << 18), dtype=dtype)
                self._scratch[key] = buf
        return buf[:count]

    def pinned(self, channel: int, nbytes: int) -> list[Any]:
        """Channel ``channel``'s two pinned host buffers for staging, at least ``nbytes`` each."""
        with self._lock:
            hosts = self._pinned.get(channel)
            if hosts is None or hosts[0].nbytes < nbytes:
                if hosts is not None:
                    self.idle()
                hosts = [self.cupyx.empty_pinned((nbytes,), dtype=np.uint8) for _ in range(2)]
                self._pinned[channel] = hosts
        return hosts

    def host_scratch(self, channel: int) -> Scratch:
        """Channel ``channel``'s host scratch for the CPU's rank-order fold."""
        return self._host_scratch.setdefault(channel, Scratch())

    def packer(self, arrays: tuple[Sequence[Any], tuple[int, ...]], fused: Any) -> Packer:
        """The Packer of a layout: ``arrays`` are the tensors with their addresses."""
        addresses = arrays[1]
        nbytes = tuple([int(a.nbytes) for a in arrays[0]])
        key = (addresses, nbytes, int(fused.data.ptr))
        packer = self._packers.get(key)
        if packer is None:
            if len(self._packers) > 256:  # layouts change (new tensors): keep the cache small
                self.idle()  # a dropped packer's tables may still be read by a kernel
                self._packers.clear()
            packer = Packer(addresses, nbytes, int(fused.data.ptr))
            self._packers[key] = packer
        return packer

    def clear(self) -> None:
        """Drop the cached views, tables and scratch (the group is closing)."""
        self._packers.clear()
        self._scratch.clear()
        self._host_scratch.clear()
        self._pinned.clear()
        self._fused_views.clear()


__all__ = ["DeviceBuffers", "addressed"]
