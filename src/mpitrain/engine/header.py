"""The negotiation round on the wire: one header per rank, and small allreduces riding along.

Every round each rank of a set sends one header (:mod:`.negotiation` says what its words
mean): its cache hits and the stuck word, AND-reduced; its stale bits and flags, OR-reduced,
travelling inverted so that one AND carries both; autotune's extra words, AND-reduced.

In a set of two ranks the headers are all-gathered instead, each followed by a *ride area*
of ``MPITRAIN_ROUND_RIDE_BYTES`` (default 256): the inputs of this rank's pending small CPU
allreduces that are cached (every rank knows their metas, so the bytes need no description
beyond their cache bits).  A small allreduce whose input rode on both ranks is reduced by
each from the gathered inputs, exactly as :func:`mpitrain.ops.reference.reduce` defines it:
the same bits on both, and nothing left for the data plane.  A lone small allreduce between
two nodes then costs one round trip instead of two (the round's and MPI's own): 0.13 ms
instead of 0.16-0.18 ms across two namespace hosts (MPI's own 0.015 ms).

Why two ranks only: between two ranks every elementwise reduction is one operation, which
commutes, so a tensor gets the same bits whether it rode or was left to the data plane (too
many at once, a full area), as bit-for-bit resumption and equal results for a tensor alone or
fused need.  From three ranks a floating-point sum depends on the order (rank order here,
MPI's own order there), and all-gathering the headers cost 30-75 us more per round than
AND-reducing them across two hosts x two ranks.  ``MPITRAIN_DETERMINISTIC`` turns riding
off: its designs define the bits.

A ride area: a 32-bit count ``n``, ``n`` 32-bit cache bits, then the inputs, back to back in
that order.  Who packed what is read from the areas themselves, so a rank whose area was full
simply leaves an allreduce to the data plane, and every rank sees that it did.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ..core.dtypes import STORAGE, ReduceOp
from ..ops import reference
from .cache import ResponseCache
from .request import Kind, Request, average_as_sum

RIDE_RANKS = 2  # the set size whose rounds gather their headers (and ride); others AND them
_COUNT = np.dtype("<u4")
_WORD = (1 << 64) - 1
_MAX_RIDERS = 16  # more pending at once: a burst of gradients, left to fusion
_ALL_ONES_BYTES = b"\xff" * 8
_NO_RIDERS = bytes(_COUNT.itemsize)  # an area's count when nothing rode in it
_RIDING_OPS = (ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


def can_ride(request: Request, area_bytes: int) -> bool:
    """Whether ``request``'s input may ride the round in a ride area of ``area_bytes`` (given
    that it is a cache hit): one small CPU tensor of an elementwise allreduce."""
    if request.kind != Kind.ALLREDUCE or len(request.entries) != 1 or request.device != "cpu":
        return False
    entry = request.entries[0]
    return (request.op in _RIDING_OPS and entry.input is not None
            and entry.input.nbytes + 2 * _COUNT.itemsize <= area_bytes)


class Header(NamedTuple):
    """One rank's header words, or, once exchanged, the set's."""

    hits: int  # cache bits pending here / ready on every rank
    stale: int  # cache bits stale here / anywhere
    flags: int  # negotiation's F_* flags set here / anywhere
    stuck: bool  # this rank is stuck / every rank is
    extra: np.ndarray | None  # autotune's words (AND-reduced), None without them


class RoundWire:
    """How one process set's round header crosses the wire on this rank."""

    def __init__(self, comm: Any, cache: ResponseCache, extra_words: int,
                 area_bytes: int) -> None:
        """``extra_words``: autotune's words at the header's end (0 or the same number on
        every rank); ``area_bytes``: each rank's ride area, 0 for none (the same on every
        rank: the configuration)."""
        self.comm = comm
        self.cache = cache
        self.extra_words = extra_words
        self.size = comm.Get_size()
        self.area_bytes = area_bytes
        self.gathers = area_bytes > 0 and self.size == RIDE_RANKS
        self.riders: dict[int, Request] = {}  # cache bit -> pending hit that may ride
        self.rode = 0  # allreduces finished in the round, for tests and the benchmarks
        self._riders_by_bit: dict[int, _Rider] = {}

    def offer(self, bit: int, request: Request) -> None:
        """Take a pending cache hit into the next rounds' ride areas, if it may ride."""
        if self.gathers and can_ride(request, self.area_bytes):
            self.riders[bit] = request

    def done(self, bit: int) -> None:
        """The hit under ``bit`` was decided: it rides no more (others leave lazily)."""
        self.riders.pop(bit, None)

    def exchange(self, mine: Header, hits: dict[int, Request],
                 wait: Callable[[Any], None]) -> tuple[Header, dict[int, np.ndarray]]:
        """Send this rank's header (``hits``: its pending cache hits, which may ride); return
        the set's, and the results of the allreduces that rode (see :meth:`reduced`).

        The words are built and read as Python integers (a few dozen nanoseconds each) and
        cross the wire as one buffer: this is paid on every synchronous call.
        """
        width = (self.cache.num_bits + 63) // 64 * 8  # bytes of one bit field
        everything = (1 << (8 * width)) - 1
        tail = b""
        if self.extra_words:
            tail = (_ALL_ONES_BYTES * self.extra_words if mine.extra is None
                    else np.asarray(mine.extra, dtype="<u8").tobytes())
        raw = bytearray(mine.hits.to_bytes(width, "little")
                        + (everything ^ mine.stale).to_bytes(width, "little")
                        + (_WORD ^ mine.flags).to_bytes(8, "little")
                        + int(mine.stuck).to_bytes(8, "little") + tail)
        areas: list[bytes] = []
        if self.gathers:
            raw, areas = self._gather(raw, hits, wait)
        else:
            wait(self.comm.Iallreduce(MPI.IN_PLACE, np.frombuffer(raw, dtype="<u8"),
                                      op=MPI.BAND))
        ready = int.from_bytes(raw[:width], "little")
        stale = everything ^ int.from_bytes(raw[width:2 * width], "little")
        flags = _WORD ^ int.from_bytes(raw[2 * width:2 * width + 8], "little")
        extra = (np.frombuffer(raw, dtype="<u8")[2 * width // 8 + 2:].astype(np.uint64)
                 if self.extra_words else None)
        theirs = Header(ready, stale, flags, raw[2 * width + 8:2 * width + 16] != bytes(8), extra)
        return theirs, self.reduced(areas, ready & ~stale)

    def _gather(self, raw: bytearray, hits: dict[int, Request],
                wait: Callable[[Any], None]) -> tuple[bytearray, list[bytes]]:
        """All-gather this rank's header and ride area; the AND of the headers, and every
        rank's area.  Bytes and Python integers throughout: numpy's per-call costs would
        double this round's, which a synchronous call pays every time."""
        row = raw + self._area(hits)
        rows = bytearray(len(row) * self.size)
        wait(self.comm.Iallgather([row, MPI.BYTE], [rows, MPI.BYTE]))
        hlen = len(raw)
        anded = -1
        areas = []
        for start in range(0, len(rows), len(row)):
            anded &= int.from_bytes(rows[start:start + hlen], "little")
            areas.append(bytes(rows[start + hlen:start + len(row)]))
        return bytearray(anded.to_bytes(hlen, "little")), areas

    def _area(self, hits: dict[int, Request]) -> bytes:
        """This rank's ride area: the riders still pending, lowest bit first, while they fit.

        Many riders at once are a backward pass's small gradients, which fusion already
        moves in a few collectives: then nothing rides, and no round pays for sorting them.
        """
        if not self.riders:
            return bytes(self.area_bytes)
        # Only hits still pending under the same bit: a bit given up since may name another
        # tensor in the cache now, whose size would misplace everything after it.
        self.riders = {b: r for b, r in self.riders.items() if hits.get(b) is r}
        if not self.riders or len(self.riders) > _MAX_RIDERS:
            return bytes(self.area_bytes)
        room = self.area_bytes - _COUNT.itemsize
        packed: list[int] = []
        inputs: list[bytes] = []
        used = 0
        for bit in sorted(self.riders):
            x = self.riders[bit].entries[0].input
            assert x is not None
            used += x.nbytes + _COUNT.itemsize
            if used > room:
                break  # full: the data plane reduces the rest
            packed.append(bit)
            inputs.append(np.ascontiguousarray(x).tobytes())
        area = np.array([len(packed), *packed], dtype=_COUNT).tobytes() + b"".join(inputs)
        return area + bytes(self.area_bytes - len(area))

    def reduced(self, areas: list[bytes], ready: int) -> dict[int, np.ndarray]:
        """The results of the allreduces that rode on every rank and are ready everywhere
        (``ready``: their cache bits), by cache bit; the same on every rank."""
        if not areas or any(area[:_COUNT.itemsize] == _NO_RIDERS for area in areas):
            return {}  # nothing rode on some rank, so nothing rode everywhere
        where: list[dict[int, int]] = []  # per rank: bit -> offset of its input
        for area in areas:
            count = int.from_bytes(area[:_COUNT.itemsize], "little")
            offset = _COUNT.itemsize * (count + 1)
            offsets = {}
            for bit in np.frombuffer(area, dtype=_COUNT, count=count,
                                     offset=_COUNT.itemsize).tolist():
                offsets[bit] = offset
                offset += self._rider(bit).nbytes
            where.append(offsets)
        out = {}
        for bit in where[0]:
            if not (ready >> bit) & 1 or any(bit not in w for w in where):
                continue
            rider = self._rider(bit)
            inputs = [np.frombuffer(area, dtype=rider.storage, count=rider.elements,
                                     offset=w[bit])
                      for area, w in zip(areas, where)]
            if rider.float_sum:
                out[bit] = _float_sum(inputs[0], inputs[1], rider.postscale)
            else:
                out[bit] = reference.reduce(inputs, rider.dtype, rider.op, rider.prescale,
                                            rider.postscale)
        self.rode += len(out)
        return out

    def _rider(self, bit: int) -> _Rider:
        """How the single-tensor allreduce cached under ``bit`` is read and reduced, worked out
        once per cache entry (a synchronous call pays for this every round)."""
        entry = self.cache.entry(bit)
        assert entry is not None
        rider = self._riders_by_bit.get(bit)
        if rider is None or rider.entry is not entry:
            meta = entry[1]
            dtype, _ndim, shape = meta.tensors[0]
            storage = STORAGE[dtype]
            op, post = average_as_sum(ReduceOp(meta.reduce_op), meta.postscale, self.size)
            elements = math.prod(shape)
            rider = _Rider(entry, dtype, storage, elements, elements * storage.itemsize, op,
                           meta.prescale, post,
                           dtype in ("float32", "float64") and op == ReduceOp.SUM
                           and meta.prescale == 1.0)
            self._riders_by_bit[bit] = rider
        return rider


class _Rider(NamedTuple):
    """What reading and reducing a riding input takes, from its cache entry."""

    entry: tuple[str, Any]  # the cache entry it was worked out from (bits get reused)
    dtype: str
    storage: np.dtype
    elements: int
    nbytes: int
    op: ReduceOp  # Average already a Sum (average_as_sum)
    prescale: float
    postscale: float
    float_sum: bool  # a float32/float64 Sum or Average without a prescale: see _float_sum


def _float_sum(a: np.ndarray, b: np.ndarray, postscale: float) -> np.ndarray:
    """``reference.reduce([a, b], ...)`` of a float32 or float64 Sum without a prescale: the
    same operations in the same order, so the same bits (a metric's average, the common
    rider), without the general function's dispatch, which cost three times the addition on
    every synchronous call."""
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are results, as there
        acc = a + b
        if postscale != 1.0:
            acc = acc * acc.dtype.type(postscale)
    return acc


__all__ = ["RIDE_RANKS", "Header", "RoundWire", "can_ride"]
