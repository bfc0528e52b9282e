"""Batched pack/unpack: many gradient tensors into (out of) one fusion buffer in one launch.

The host builds a chunk table once per bucket layout: every tensor is cut into chunks of at
most ``CHUNK_UNITS`` copy units, and row c of the table says which tensor chunk c reads, where
in it, where in the fusion buffer, and how long.  Block b of the kernel copies chunks b,
b + gridDim, ... with its threads striding over the chunk, so reads and writes are coalesced and
no thread searches for its tensor.  Tensors are reached through a table of raw device pointers
(numba cannot index such a table, so this kernel is CUDA C through cupy's RawKernel).

The copy unit is the widest of 16, 8, 4, 2, 1 bytes dividing every address and length, so
typical float32 gradients (256-byte aligned allocations) move as 16-byte vectors.

CI has no GPU: :func:`emulate` runs the same table through the same loop order in numpy, and
the tests check the table's invariants and the emulated result against a plain concatenation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .probe import require

CHUNK_UNITS = 4096  # copy units per chunk: 64 KiB of 16-byte vectors, several waves per block
THREADS = 256
MAX_BLOCKS = 4096

# Columns of the chunk table.
TENSOR, SRC, DST, LENGTH = range(4)

_UNIT_TYPES = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short",
               1: "unsigned char"}

_SOURCE = r"""
extern "C" __global__ void mpitrain_pack_UNIT(const unsigned long long* pointers,
                                              const long long* table, long long chunks,
                                              T* fused, int unpack) {
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        const long long* row = table + 4 * c;
        T* tensor = reinterpret_cast<T*>(pointers[row[0]]);
        T* src_or_dst = tensor + row[1];
        T* slot = fused + row[2];
        const long long length = row[3];
        if (unpack) {
            for (long long k = threadIdx.x; k < length; k += blockDim.x) src_or_dst[k] = slot[k];
        } else {
            for (long long k = threadIdx.x; k < length; k += blockDim.x) slot[k] = src_or_dst[k];
        }
    }
}
"""


def copy_unit(addresses: Sequence[int], nbytes: Sequence[int]) -> int:
    """The widest copy unit (bytes) dividing every address and every length (and offsets)."""
    for unit in (16, 8, 4, 2):
        if all(a % unit == 0 for a in addresses) and all(n % unit == 0 for n in nbytes):
            return unit
    return 1


def chunk_table(lengths: Sequence[int], chunk_units: int = CHUNK_UNITS) -> np.ndarray:
    """Rows (tensor, offset in tensor, offset in fusion buffer, length), all in copy units.

    Tensors lie back to back in the fusion buffer in the given order (the engine's bucket
    order, identical on every rank); empty tensors get no rows.
    """
    if chunk_units <= 0:
        raise ValueError(f"chunk_units must be positive, got {chunk_units}")
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    if (lengths_arr < 0).any():
        raise ValueError(f"tensor lengths must be non-negative, got {list(lengths)}")
    starts = np.concatenate(([0], np.cumsum(lengths_arr)[:-1])).astype(np.int64)
    per_tensor = (lengths_arr + chunk_units - 1) // chunk_units
    tensor = np.repeat(np.arange(len(lengths_arr), dtype=np.int64), per_tensor)
    # Index of each chunk within its tensor.
    first_row = np.concatenate(([0], np.cumsum(per_tensor)[:-1])).astype(np.int64)
    within = np.arange(tensor.size, dtype=np.int64) - np.repeat(first_row, per_tensor)
    src = within * chunk_units
    length = np.minimum(chunk_units, lengths_arr[tensor] - src)
    table = np.empty((tensor.size, 4), dtype=np.int64)
    table[:, TENSOR] = tensor
    table[:, SRC] = src
    table[:, DST] = starts[tensor] + src
    table[:, LENGTH] = length
    return table


def emulate(table: np.ndarray, tensors: Sequence[np.ndarray], fused: np.ndarray,
            unpack: bool, blocks: int) -> None:
    """Run the kernel's loops on the CPU: block b takes chunks b, b + blocks, ...

    ``tensors`` and ``fused`` are flat arrays of the copy unit's width (the kernel's ``T``).
    """
    for b in range(blocks):
        for c in range(b, table.shape[0], blocks):
            t, src, dst, length = (int(v) for v in table[c])
            if unpack:
                tensors[t][src:src + length] = fused[dst:dst + length]
            else:
                fused[dst:dst + length] = tensors[t][src:src + length]


def kernel_source(unit: int) -> tuple[str, str]:
    """(CUDA C source, entry name) of the kernel moving ``unit``-byte copy units.

    Raises:
        ValueError: ``unit`` is not one of 1, 2, 4, 8, 16.
    """
    if unit not in _UNIT_TYPES:
        raise ValueError(f"copy unit must be one of {sorted(_UNIT_TYPES)} bytes, got {unit!r}")
    source = _SOURCE.replace("UNIT", str(unit)).replace("T*", f"{_UNIT_TYPES[unit]}*")
    return source, f"mpitrain_pack_{unit}"


UNITS = tuple(sorted(_UNIT_TYPES))


@functools.cache
def _kernel(unit: int) -> Any:
    cupy = require("the CUDA pack kernel")
    return cupy.RawKernel(*kernel_source(unit))


class Packer:
    """Packs one bucket layout; built once per layout and reused while the layout repeats."""

    def __init__(self, addresses: Sequence[int], nbytes: Sequence[int],
                 fused_address: int) -> None:
        cupy = require("the CUDA pack kernel")
        self.unit = copy_unit([*addresses, fused_address], nbytes)
        self.total_bytes = int(sum(nbytes))
        lengths = [n // self.unit for n in nbytes]
        table = chunk_table(lengths)
        self.chunks = int(table.shape[0])
        self.blocks = max(1, min(MAX_BLOCKS, self.chunks))
        self._table = cupy.asarray(table.reshape(-1))
        self._pointers = cupy.asarray(np.asarray(addresses, dtype=np.uint64))
        # The uploads ran on this thread's current stream, from pageable memory: the call
        # returns once the bytes are staged, not when they reach the device, and the kernel
        # runs on another (non-blocking) stream that is not ordered after this one.  Without
        # this wait the kernel can read a half-written pointer table (on an H100: an illegal
        # address, now and then, at the first bucket of each new layout).
        cupy.cuda.get_current_stream().synchronize()
        self._fused_address = fused_address

    def _launch(self, fused: Any, unpack: bool, stream: Any) -> None:
        if self.chunks == 0:
            return
        if int(fused.data.ptr) != self._fused_address:
            raise ValueError("this Packer was built for another fusion buffer "
                             f"(0x{self._fused_address:x}, got 0x{int(fused.data.ptr):x})")
        with stream:
            _kernel(self.unit)((self.blocks,), (THREADS,),
                               (self._pointers, self._table, np.int64(self.chunks), fused,
                                np.int32(1 if unpack else 0)))

    def pack(self, fused: Any, stream: Any) -> None:
        """Copy every tensor into ``fused`` (a cupy array at the address given at build)."""
        self._launch(fused, False, stream)

    def unpack(self, fused: Any, stream: Any) -> None:
        """Copy ``fused`` back out into every tensor."""
        self._launch(fused, True, stream)
