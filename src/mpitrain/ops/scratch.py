"""Reusable scratch buffers by name: grown when a run needs more, never shrunk.

One algorithm run at a time uses a given Scratch (each communicator / node / group has its
own), so handing out the same memory again is safe and saves the page faults of fresh buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_BYTES = np.dtype(np.uint8)


def _plain(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class Scratch:
    """Named byte buffers, viewed as the dtype each caller asks for."""

    def __init__(self, allocate: Callable[[int], np.ndarray] = _plain) -> None:
        self._allocate = allocate  # nbytes -> uint8 array
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, count: int, dtype: np.dtype | type = _BYTES) -> np.ndarray:
        """At least ``count`` elements of ``dtype`` under ``key`` (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self._allocate(max(nbytes, 64))
            self._bufs[key] = buf
        return buf[:nbytes].view(dtype)

    def clear(self) -> None:
        self._bufs.clear()
