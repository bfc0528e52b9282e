"""Order-free floating-point sums: every element summed as integers on a shared exponent.

``MPITRAIN_DETERMINISTIC=fixed-point``.  Integer addition is associative, so a sum of integers
has one result whatever the algorithm, the order of the ranks, how many ranks hold zeros, or
how the buffer was cut.  Each element of a Sum/Average becomes an integer in three steps:

1. every rank computes the prescaled value ``v = x * prescale`` in the accumulation type
   (float32 for float16/bfloat16/float32, float64 for float64) and its biased exponent field;
   one allreduce of these fields with Max gives every rank, for every element, ``e`` with
   ``|v| < 2**e`` on every rank (one byte per element; two for float64);
2. every rank turns ``v`` into ``round(v * 2**(F - e))``, an integer of at most ``F`` bits
   (``F`` below), and an allreduce of these integers with Sum adds them exactly (any
   algorithm, any order: integers, wrapping in two's complement, are associative);
3. the sum ``S`` becomes ``float(S) * 2**(e - F) * postscale``, rounded to the element type.

``F`` leaves :data:`HEADROOM_BITS` bits for the sum of :data:`MAX_RANKS` ranks at most, a
constant, so that a world of 3 ranks quantizes exactly as a world of 300 does:

* float16/bfloat16: 32-bit integers, ``F`` = 17 (5 bytes per element travel instead of 2);
* float32: 64-bit integers, ``F`` = 49 (9 bytes instead of 4);
* float64: two 64-bit words, ``F`` = 49 + 49: ``hi = floor(v * 2**(F - e))`` and ``lo`` the
  rounded remaining 49 bits (18 bytes instead of 8), interleaved per element.

What it costs in accuracy: a rank's value is rounded to a multiple of ``2**(e - F)``, so each
element's error is at most ``p * 2**(e - F - 1)``, i.e. at most ``p * 2**-17`` (16-bit types),
``p * 2**-49`` (float32) or ``p * 2**-98`` (float64) times the largest magnitude any rank held
there, plus the final rounding.  Values within ``F - 24`` binades of that largest one (25 for
float32, whose values have 24 bits) convert exactly: for float32 gradients the result is then
the exact sum rounded once, better than any order of float32 additions.

Infinities and NaN: an element where any rank holds one is counted instead (+inf 1, -inf
``1 << INF_SHIFT``, NaN both), and comes out +inf, -inf or NaN as IEEE addition would give
(NaN's payload is not kept).  A sum that overflows the element type is an infinity.  A sum of
zeros is +0 (never -0).

The arithmetic is :func:`reference` in numpy, which the kernels (:mod:`.kernels.fixed_point`,
and on the GPU :mod:`.cuda.fixed_point`) match bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..core.dtypes import STORAGE, ReduceOp
from . import reference as plain
from .kernels import cpu
from .kernels import fixed_point as kernels
from .reduction import Reduction, check_floating
from .scratch import Scratch

HEADROOM_BITS = 14
MAX_RANKS = (1 << HEADROOM_BITS) - 1
# Elements converted per kernel call: the float32 widening scratch of 16-bit types stays in
# cache, and the per-call Python cost (~10 us) stays below 1% of the pass.
_CHUNK = 1 << 18


@dataclass(frozen=True)
class Layout:
    """How one element type travels as integers."""

    exps: str  # the exponent fields' type (uint8, or int16 for float64's 11 bits)
    word: str  # the integers' type
    words: int  # integers per element
    frac_bits: int  # F


LAYOUTS: dict[str, Layout] = {
    "float16": Layout("uint8", "int32", 1, 31 - HEADROOM_BITS),
    "bfloat16": Layout("uint8", "int32", 1, 31 - HEADROOM_BITS),
    "float32": Layout("uint8", "int64", 1, 63 - HEADROOM_BITS),
    "float64": Layout("int16", "int64", 2, 63 - HEADROOM_BITS),
}


class IntegerCollectives(Protocol):
    """The exact collectives the fixed-point sum runs on (any algorithm will do)."""

    scratch: Scratch

    def allreduce(self, buf: np.ndarray, dtype: str, op: ReduceOp) -> None:
        """Reduce ``buf`` in place across the group."""

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                      dtype: str, op: ReduceOp) -> None:
        """Rank i keeps the reduction of block i (``counts[i]`` elements) in ``recv``."""


def check_world(size: int) -> None:
    """Raise when the world is too large for the fixed-point sum's headroom.

    Raises:
        ValueError: more than :data:`MAX_RANKS` ranks.
    """
    if size > MAX_RANKS:
        raise ValueError(f"MPITRAIN_DETERMINISTIC=fixed-point sums at most {MAX_RANKS} ranks "
                         f"exactly, this job has {size}; use rank-order")


def layout(how: Reduction) -> Layout:
    return LAYOUTS[how.dtype]


def allreduce(send: np.ndarray, recv: np.ndarray, how: Reduction, net: IntegerCollectives) -> None:
    """Sum ``send`` over the group into ``recv`` (which may be ``send``), order-free.

    Every rank of the group must call this, in the same order, with the same ``how``.
    """
    _check_sum(how)
    n = send.size
    if n == 0:
        return
    exps, words = _buffers(net.scratch, layout(how), n)
    exponents(send, how, exps)
    net.allreduce(exps, layout(how).exps, ReduceOp.MAX)
    encode(send, how, exps, words)
    net.allreduce(words, layout(how).word, ReduceOp.SUM)
    decode(words, exps, how, recv, net.scratch)


def reducescatter(send: np.ndarray, recv: np.ndarray, counts: Sequence[int], rank: int,
                  how: Reduction, net: IntegerCollectives) -> None:
    """Rank ``rank`` keeps the order-free sum of block ``rank`` (``counts[rank]`` long)."""
    _check_sum(how)
    n = send.size
    if n == 0:
        return
    lay = layout(how)
    exps, words = _buffers(net.scratch, lay, n)
    exponents(send, how, exps)
    net.allreduce(exps, lay.exps, ReduceOp.MAX)  # every block's, to encode every block
    encode(send, how, exps, words)
    lo = sum(counts[:rank])
    mine = net.scratch.get("fixed.mine", counts[rank] * lay.words, STORAGE[lay.word])
    net.reducescatter(words, mine, [c * lay.words for c in counts], lay.word,
                      ReduceOp.SUM)
    decode(mine, exps[lo:lo + counts[rank]], how, recv, net.scratch)


def _check_sum(how: Reduction) -> None:
    check_floating(how)
    if how.op != ReduceOp.SUM:
        raise ValueError(f"the fixed-point sum sums; {how.op!r} goes to the rank-order fold")


def _buffers(scratch: Scratch, lay: Layout, n: int) -> tuple[np.ndarray, np.ndarray]:
    return (scratch.get("fixed.exps", n, STORAGE[lay.exps]),
            scratch.get("fixed.words", n * lay.words, STORAGE[lay.word]))


def _chunks(n: int) -> range:
    return range(0, n, _CHUNK)


def _prescale(how: Reduction) -> np.floating:
    return np.float64(how.prescale) if how.dtype == "float64" else np.float32(how.prescale)


def exponents(send: np.ndarray, how: Reduction, exps: np.ndarray) -> None:
    """Step 1 on this rank: the exponent field of every prescaled element."""
    pre = _prescale(how)
    if how.dtype == "float64":
        kernels.exponents64(send, pre, exps)
        return
    if how.dtype == "float32":
        kernels.exponents32(send, pre, exps)
        return
    tmp = np.empty(min(_CHUNK, send.size), np.float32)
    for s in _chunks(send.size):
        e = min(s + _CHUNK, send.size)
        cpu.widen_into(tmp[:e - s], send[s:e], how.dtype, 1.0)
        kernels.exponents32(tmp[:e - s], pre, exps[s:e])


def encode(send: np.ndarray, how: Reduction, exps: np.ndarray, words: np.ndarray) -> None:
    """Step 2 on this rank: every element as integers on the agreed exponents."""
    pre, bits = _prescale(how), layout(how).frac_bits
    if how.dtype == "float64":
        pairs = words.reshape(-1, 2)
        kernels.encode64(send, pre, exps, bits, pairs[:, 0], pairs[:, 1])
        return
    if how.dtype == "float32":
        kernels.encode32(send, pre, exps, bits, words)
        return
    tmp = np.empty(min(_CHUNK, send.size), np.float32)
    for s in _chunks(send.size):
        e = min(s + _CHUNK, send.size)
        cpu.widen_into(tmp[:e - s], send[s:e], how.dtype, 1.0)
        kernels.encode32(tmp[:e - s], pre, exps[s:e], bits, words[s:e])


def decode(words: np.ndarray, exps: np.ndarray, how: Reduction, out: np.ndarray,
           scratch: Scratch) -> None:
    """Step 3: the summed integers back to the element type, postscaled, into ``out``."""
    bits = layout(how).frac_bits
    if how.dtype == "float64":
        pairs = words.reshape(-1, 2)
        kernels.decode64(pairs[:, 0], pairs[:, 1], exps, np.float64(how.postscale), bits, out)
        return
    if how.dtype == "float32":
        kernels.decode32(words, exps, np.float64(how.postscale), bits, out)
        return
    n = exps.size
    tmp = scratch.get("fixed.narrow", min(_CHUNK, n), np.float32)
    for s in _chunks(n):
        e = min(s + _CHUNK, n)
        kernels.decode32(words[s:e], exps[s:e], np.float64(how.postscale), bits, tmp[:e - s])
        cpu.narrow_into(out[s:e], tmp[:e - s], how.dtype)


# ------------------------------------------------------------------ the meaning, in numpy
def _pow2(k: np.ndarray) -> np.ndarray:
    return ((k.astype(np.int64) + 1023) << 52).view(np.float64)


def reference(inputs: Sequence[np.ndarray], dtype: str, prescale: float = 1.0,
              postscale: float = 1.0) -> np.ndarray:
    """What :func:`allreduce` computes from every rank's input (storage arrays), in numpy.

    Plain numpy on purpose, sharing nothing with the kernels but the constants, so that the
    tests hold the kernels, CPU and GPU, to an independent statement of the arithmetic.
    """
    bits = LAYOUTS[dtype].frac_bits
    values: list[np.ndarray]
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype == "float64":
            values = [np.asarray(x, np.float64) * np.float64(prescale) for x in inputs]
            fields = [(v.view(np.uint64) >> np.uint64(52)).astype(np.int64) & 0x7FF
                      for v in values]
            special = 0x7FF
        else:
            values = [plain.widen(np.asarray(x), dtype).astype(np.float32)
                      * np.float32(prescale) for x in inputs]
            fields = [(v.view(np.uint32) >> np.uint32(23)).astype(np.int64) & 0xFF
                      for v in values]
            special = 0xFF
        b = np.maximum.reduce(fields)
        is_special = b == special
        bias = 1022 if dtype == "float64" else 126
        e = np.maximum(b, 1) - bias
        counts = sum(np.where(np.isnan(v), 1 + (1 << kernels.INF_SHIFT),
                              np.where(v == np.inf, 1,
                                       np.where(v == -np.inf, 1 << kernels.INF_SHIFT, 0)))
                     for v in values)
        pos, neg = counts & ((1 << kernels.INF_SHIFT) - 1), counts >> kernels.INF_SHIFT
        specials = np.where((pos > 0) & (neg > 0), np.nan, np.where(pos > 0, np.inf,
                                                        np.where(neg > 0, -np.inf, np.nan)))
        k = np.where(is_special, 0, bits - e)
        if dtype == "float64":
            hi = np.zeros(b.shape, np.int64)
            lo = np.zeros(b.shape, np.int64)
            half = k // 2
            for v in values:
                w = np.where(is_special, 0.0, v) * _pow2(half) * _pow2(k - half)
                whole = np.floor(w)
                hi += whole.astype(np.int64)
                lo += np.floor((w - whole) * _pow2(np.full(b.shape, bits)) + 0.5).astype(np.int64)
            carry = lo >> bits
            whole_sum = hi + carry
            rem = lo - (carry << bits)
            a = whole_sum.astype(np.float64)
            t = (whole_sum - a.astype(np.int64)).astype(np.float64) \
                + rem.astype(np.float64) * _pow2(np.full(b.shape, -bits))
            kd = np.where(is_special, 0, e - bits)
            halfd = kd // 2
            out = (a + t) * _pow2(halfd) * _pow2(kd - halfd) * np.float64(postscale)
            return np.where(is_special, specials, out)
        total = np.zeros(b.shape, np.int64)
        for v in values:
            w = np.where(is_special, np.float32(0), v).astype(np.float64) * _pow2(k)
            total += np.floor(w + 0.5).astype(np.int64)
        scaled = total.astype(np.float64) * _pow2(np.where(is_special, 0, e - bits)) \
            * np.float64(postscale)
        wide = np.where(is_special, specials, scaled).astype(np.float32)
        return plain.narrow(wide, dtype)
