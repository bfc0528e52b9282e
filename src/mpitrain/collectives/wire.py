"""The 16-bit wire buffers of the functional ``allreduce(..., compression=fp16/bf16)``.

``compress`` would cast each float32 tensor into a new 16-bit tensor, the engine would reduce
it into another new one, and ``decompress`` would widen that into a third: three fresh
allocations per call, each paid again in page faults (on 2 cores with 4 ranks, 32 MiB of
float32 spent more time there than on a 1 Gbit/s link's 16 MiB of fp16).  Here the tensor is
cast into a 16-bit buffer kept from call to call, reduced there in place, as
``DistributedOptimizer``'s wire buckets are, and widened once into the result the caller owns
(recycled memory, as every collective's large output).

Only the compressors that just cast take this path, and only for host (CPU) float32/float64
tensors: a CUDA tensor's caching allocator already reuses memory, and a buffer reused across
CUDA streams would need events for nothing.  Anything else goes through ``compress``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from . import arrays
from .casts import BF16Compressor, FP16Compressor, numpy_wire_dtype

# The compressors whose compress() is exactly "cast to wire_dtype" (a subclass may override it).
_CASTS = (FP16Compressor, BF16Compressor)
# Free buffers kept between calls, all sizes together; the oldest size goes first beyond it.
KEEP_BYTES = 256 << 20


class _Pool:
    """Free wire buffers by (kind, wire dtype, elements); taken for one call, then given back.

    Two calls in flight at once (threads) take two buffers, never one.
    """

    def __init__(self) -> None:
        self._free: OrderedDict[tuple[str, str, int], list[Any]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, like: Any, wire: str, numel: int) -> Any:
        key = ("torch" if arrays.is_torch(like) else "numpy", wire, numel)
        with self._lock:
            free = self._free.get(key)
            if free:
                buf = free.pop()
                self._bytes -= _nbytes(buf)
                return buf
        return _new_buffer(like, wire, numel)

    def give_back(self, like: Any, wire: str, buf: Any) -> None:
        key = ("torch" if arrays.is_torch(like) else "numpy", wire, _numel(buf))
        with self._lock:
            self._free.setdefault(key, []).append(buf)
            self._free.move_to_end(key)
            self._bytes += _nbytes(buf)
            while self._bytes > KEEP_BYTES and self._free:
                oldest, bufs = next(iter(self._free.items()))
                self._bytes -= _nbytes(bufs.pop(0))
                if not bufs:
                    del self._free[oldest]


def _nbytes(buf: Any) -> int:
    return int(buf.nbytes) if isinstance(buf, np.ndarray) else int(buf.numel() * buf.element_size())


def _numel(buf: Any) -> int:
    return int(buf.size if isinstance(buf, np.ndarray) else buf.numel())


def _new_buffer(like: Any, wire: str, numel: int) -> Any:
    if arrays.is_torch(like):
        torch = arrays.loaded_torch()
        return torch.empty(numel, dtype=getattr(torch, wire))
    return np.empty(numel, dtype=numpy_wire_dtype(wire))


_POOL = _Pool()


class Narrowed:
    """One tensor cast into a pooled wire buffer; ``widened()`` makes the caller's result."""

    def __init__(self, tensor: Any, wire: str) -> None:
        self.tensor, self.wire = tensor, wire
        numel = _numel(tensor)
        self._flat = _POOL.take(tensor, wire, numel)
        self.buffer = self._flat.view(tuple(tensor.shape)) if arrays.is_torch(tensor) \
            else self._flat.reshape(tensor.shape)
        if arrays.is_torch(tensor):
            self.buffer.copy_(tensor.detach())
        else:
            np.copyto(self.buffer, tensor, casting="unsafe")

    def widened(self) -> Any:
        """The reduced values in the original tensor's dtype, in a new tensor: from recycled
        memory when large, as any collective's output
        (:func:`mpitrain.collectives.arrays.empty_like`),
        so a loop that drops last step's result touches mapped pages, not fresh ones."""
        out, _ = arrays.empty_like(self.tensor)
        if arrays.is_torch(self.tensor):
            out.copy_(self.buffer)
        else:
            np.copyto(out, self.buffer, casting="unsafe")
        return out

    def release(self) -> None:
        _POOL.give_back(self.tensor, self.wire, self._flat)


def applies(tensor: Any, compression: Any) -> bool:
    """Whether ``tensor`` goes through a pooled wire buffer under ``compression``."""
    if compression not in _CASTS:
        return False
    if arrays.is_torch(tensor):
        torch = arrays.loaded_torch()
        return (not tensor.is_cuda and tensor.dtype in (torch.float32, torch.float64)
                and tensor.is_contiguous())
    return (isinstance(tensor, np.ndarray) and tensor.dtype in (np.float32, np.float64)
            and tensor.flags.c_contiguous)


def widened(narrowed: list[Narrowed]) -> list[Any]:
    """The callers' results of a reduction that completed; the wire buffers go back to the
    pool.  After a failed one they are never given back (the engine may still hold them)."""
    outs = [n.widened() for n in narrowed]
    for n in narrowed:
        n.release()
    return outs


def narrow(tensors: list[Any], compression: Any) -> list[Narrowed] | None:
    """Each tensor cast into a wire buffer, or None when any of them does not apply (then
    the caller compresses them all as before, so one call never mixes the two ways)."""
    if not tensors or not all(applies(t, compression) for t in tensors):
        return None
    taken: list[Narrowed] = []
    try:
        for t in tensors:
            taken.append(Narrowed(t, compression.wire_dtype))
    except BaseException:
        for n in taken:
            n.release()
        raise
    return taken
