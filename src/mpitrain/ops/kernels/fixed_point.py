"""numba CPU kernels of the fixed-point sum: floats to integers on a shared exponent and back.

The arithmetic is the one :mod:`mpitrain.ops.fixed_point` specifies (read its docstring
first); every step is an IEEE operation with one defined result (a multiplication by a power
of two, ``floor``, an integer-to-float conversion, one multiplication, a narrowing), so the GPU
kernels of :mod:`mpitrain.ops.cuda.fixed_point` give the same bits.  No kernel here adds a
product to anything: nothing a compiler could contract into a fused multiply-add.

Inputs of float16/bfloat16 arrive widened to float32 (the caller widens chunk by chunk with
:mod:`.cpu`'s conversions); every value is first prescaled in its accumulation type
(float32 for 16- and 32-bit types, float64 for float64), as every other path does.
"""

from __future__ import annotations

import math

import numpy as np

from .cpu import jit

# Special exponents: the biased exponent field of an infinity or NaN.
SPECIAL32 = 0xFF
SPECIAL64 = 0x7FF
# How an infinity or NaN is counted in the integer sum (the low word), so the sum says what
# the ranks held: +inf counts 1, -inf counts 1 << INF_SHIFT, NaN both (NaN wins, and
# +inf + -inf is NaN, as IEEE addition has it).  Counts stay below 1 << INF_SHIFT while the
# world has fewer ranks than that (config's limit, MAX_RANKS, is lower).
INF_SHIFT = 15


@jit
def _pow2(k):
    """2**k as a float64, exactly, for -1022 <= k <= 1023 (built from its bits)."""
    return np.int64((k + 1023) << 52).view(np.float64)


@jit
def exponents32(y, pre, out):
    """out[i] = biased exponent field of float32(y[i] * pre) (uint8)."""
    for i in range(y.size):
        v = np.float32(y[i] * pre)
        out[i] = np.uint8((v.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF))


@jit
def exponents64(y, pre, out):
    """out[i] = biased exponent field of y[i] * pre (float64; int16 out, 0..2047)."""
    for i in range(y.size):
        v = np.float64(y[i] * pre)
        out[i] = np.int16((v.view(np.uint64) >> np.uint64(52)) & np.uint64(0x7FF))


def special_count(v):
    """The integer an infinity or NaN contributes; 0 for a finite value.

    Plain Python, compiled as it is by numba for the CPU (here) and for the device
    (:mod:`mpitrain.ops.cuda.fixed_point`): one definition, so both count alike.
    """
    if v != v:
        return np.int64(1 + (1 << INF_SHIFT))
    if v == math.inf:
        return np.int64(1)
    if v == -math.inf:
        return np.int64(1 << INF_SHIFT)
    return np.int64(0)


_special_count = jit(special_count)


@jit
def encode32(y, pre, exps, frac_bits, out):
    """out[i] = round(float32(y[i] * pre) * 2**(frac_bits - e)) where every rank's |value| is
    below 2**e, e given by the agreed exponent field exps[i]; an infinity or NaN (anywhere)
    makes the element count specials instead (int32 or int64 out)."""
    for i in range(y.size):
        v = np.float32(y[i] * pre)
        b = np.int64(exps[i])
        if b == SPECIAL32:
            out[i] = _special_count(v)
            continue
        # |v| < 2**e on every rank; subnormals share the lowest binade
        e = (b if b > 1 else 1) - 126
        out[i] = np.int64(math.floor(np.float64(v) * _pow2(frac_bits - e) + 0.5))


@jit
def decode32(q, exps, post, frac_bits, out):
    """out[i] (float32) = float32(float64(q[i]) * 2**(e - frac_bits) * post); specials back."""
    for i in range(q.size):
        b = np.int64(exps[i])
        s = np.int64(q[i])
        if b == SPECIAL32:
            pos, neg = s & ((1 << INF_SHIFT) - 1), s >> INF_SHIFT
            if pos and neg:
                out[i] = np.float32(np.nan)
            elif pos:
                out[i] = np.float32(np.inf)
            elif neg:
                out[i] = np.float32(-np.inf)
            else:  # cannot happen: some rank held the special value
                out[i] = np.float32(np.nan)
            continue
        e = (b if b > 1 else 1) - 126
        out[i] = np.float32(np.float64(s) * _pow2(e - frac_bits) * post)


@jit
def encode64(y, pre, exps, frac_bits, hi, lo):
    """float64 as two words: hi = floor(v), lo = round((v - hi) * 2**frac_bits), with
    v = y[i] * pre * 2**(frac_bits - e) (the two powers of two apply one after the other: one
    alone can exceed float64's range)."""
    for i in range(y.size):
        v = np.float64(y[i] * pre)
        b = np.int64(exps[i])
        if b == SPECIAL64:
            hi[i] = _special_count(v)
            lo[i] = 0
            continue
        k = frac_bits - ((b if b > 1 else 1) - 1022)
        half = k // 2
        w = v * _pow2(half) * _pow2(k - half)
        whole = math.floor(w)
        hi[i] = np.int64(whole)
        lo[i] = np.int64(math.floor((w - whole) * _pow2(frac_bits) + 0.5))


@jit
def decode64(hi, lo, exps, post, frac_bits, out):
    """The inverse of :func:`encode64` on summed words: the low word's carry joins the high
    word, what remains is added to the high word's float64 rounding error, then scaled."""
    for i in range(hi.size):
        b = np.int64(exps[i])
        if b == SPECIAL64:
            s = np.int64(hi[i])
            pos, neg = s & ((1 << INF_SHIFT) - 1), s >> INF_SHIFT
            if neg and not pos:
                out[i] = -np.inf
            elif pos and not neg:
                out[i] = np.inf
            else:
                out[i] = np.nan
            continue
        low = np.int64(lo[i])
        carry = low >> frac_bits  # floor: rem below is in [0, 2**frac_bits)
        whole = np.int64(hi[i]) + carry
        rem = low - (carry << frac_bits)
        a = np.float64(whole)
        t = np.float64(whole - np.int64(a)) + np.float64(rem) * _pow2(-frac_bits)
        k = (b if b > 1 else 1) - 1022 - frac_bits
        half = k // 2
        out[i] = (a + t) * _pow2(half) * _pow2(k - half) * post
