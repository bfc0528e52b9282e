"""The meaning of every reduction, written plainly in numpy.

This is the specification the fast kernels must match bit for bit in integer types and to
rounding in floating types, and the fallback for element types MPI cannot reduce itself
(float16, bfloat16).  Semantics, shared by all algorithms:

* floating types accumulate in float32 (float16, bfloat16, float32) or float64 (float64);
  ``prescale`` multiplies every input before the reduction, ``postscale`` the result;
* integer types reduce in their own width (sums wrap as in C); a scale factor other than 1
  multiplies in float64 and truncates toward zero, as Horovod's integer scaling does;
* bool: Sum and Max are logical or, Min and Product logical and; no scaling.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.dtypes import FLOATING, STORAGE, ReduceOp


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 stored as uint16 to float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even; NaN stays NaN) stored as uint16."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def widen(x: np.ndarray, dtype: str) -> np.ndarray:
    """Return ``x`` in its accumulation type (float32/float64), or as is for ints and bool."""
    if dtype == "bfloat16":
        return bf16_to_f32(x)
    if dtype in ("float16", "float32"):
        return x.astype(np.float32, copy=False)
    return x


def narrow(acc: np.ndarray, dtype: str) -> np.ndarray:
    """Return the accumulator converted back to the storage type of ``dtype``, as a new array."""
    if dtype == "bfloat16":
        return f32_to_bf16(acc)
    return acc.astype(STORAGE[dtype])


def scale_int(x: np.ndarray, factor: float) -> np.ndarray:
    """Scale integers as the data plane must: in float64, truncated toward zero."""
    if factor == 1.0:
        return x
    return np.trunc(x.astype(np.float64) * factor).astype(np.int64).astype(x.dtype)


def reduce(inputs: Sequence[np.ndarray], dtype: str, op: ReduceOp,
           prescale: float = 1.0, postscale: float = 1.0) -> np.ndarray:
    """Reduce equally shaped storage arrays elementwise; Average must be given as Sum.

    Args:
        inputs: one array per rank, in rank order, of the storage type of ``dtype``.
        dtype: logical element type name.
        op: SUM, MIN, MAX or PRODUCT.
        prescale: factor applied to every input first.
        postscale: factor applied to the result.
    """
    if op not in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        raise ValueError(f"reference.reduce takes Sum/Min/Max/Product, not {op!r}")
    if dtype == "bool":
        stack = np.stack([np.asarray(x, dtype=bool) for x in inputs])
        if op in (ReduceOp.SUM, ReduceOp.MAX):
            return np.asarray(stack.any(axis=0))
        return np.asarray(stack.all(axis=0))
    if dtype in FLOATING:
        # Overflow to inf and inf - inf = NaN are results here, as in the kernels, not warnings.
        # Every step makes a new array (narrow too), so no input is ever written or returned.
        with np.errstate(over="ignore", invalid="ignore"):
            acc = None
            for x in inputs:
                w = widen(np.asarray(x), dtype)
                if prescale != 1.0:
                    w = w * w.dtype.type(prescale)
                acc = w if acc is None else _combine(acc, w, op)
            assert acc is not None
            if postscale != 1.0:
                acc = acc * acc.dtype.type(postscale)
            return narrow(acc, dtype)
    acc_i = None
    for x in inputs:
        w = scale_int(np.asarray(x), prescale)
        acc_i = w.copy() if acc_i is None else _combine(acc_i, w, op)
    assert acc_i is not None
    return scale_int(acc_i, postscale)


def _combine(acc: np.ndarray, x: np.ndarray, op: ReduceOp) -> np.ndarray:
    """A new array: ``acc`` combined with ``x`` elementwise."""
    if op == ReduceOp.SUM:
        return acc + x
    if op == ReduceOp.MIN:
        return np.minimum(acc, x)
    if op == ReduceOp.MAX:
        return np.maximum(acc, x)
    return acc * x


# Adasum: a squared norm below this counts as a zero vector (Horovod's threshold,
# sqrt(DBL_MIN)); the same number as mpitrain.ops.kernels.adasum.TINY_NORM_SQ.
ADASUM_TINY_NORM_SQ = float(np.sqrt(np.finfo(np.float64).tiny))


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b``, computed in float64, rounded to
    ``a``'s type (float32 or float64)."""
    a64, b64 = a.astype(np.float64).reshape(-1), b.astype(np.float64).reshape(-1)
    dot, aa, bb = a64 @ b64, a64 @ a64, b64 @ b64
    ca = 1.0 - dot / aa * 0.5 if aa >= ADASUM_TINY_NORM_SQ else 1.0
    cb = 1.0 - dot / bb * 0.5 if bb >= ADASUM_TINY_NORM_SQ else 1.0
    return np.asarray(ca * a64 + cb * b64).astype(a.dtype).reshape(a.shape)


def adasum(inputs: Sequence[Sequence[np.ndarray]], dtype: str, prescale: float = 1.0,
           postscale: float = 1.0, local_size: int = 1) -> list[np.ndarray]:
    """Adasum of every rank's tensors: ``inputs[rank][i]`` is rank's tensor i (storage type).

    Ranks combine pairwise up a binary tree over rank numbers, ((r0 + r1) + (r2 + r3)) + ...,
    each tensor on its own, rounding to the working type (float32, or float64 for float64)
    after every combination as the algorithm does.  With ``local_size`` L > 1 (the
    hierarchical form) each block of L consecutive ranks is averaged first (summed in rank
    order, times 1/L) and the tree runs over the blocks.  Returns one array per tensor.
    """
    work = np.dtype(np.float64 if dtype == "float64" else np.float32)

    def scaled(x: np.ndarray, factor: float) -> np.ndarray:
        return np.multiply(x, work.type(factor), dtype=work) if factor != 1.0 else x

    level: list[list[np.ndarray]] = [
        [scaled(widen(np.asarray(t), dtype).astype(work), prescale) for t in tensors]
        for tensors in inputs]
    if local_size > 1:
        nodes = []
        for start in range(0, len(level), local_size):
            block = level[start:start + local_size]
            sums = [np.sum(np.stack(ts), axis=0, dtype=work) for ts in zip(*block)]
            nodes.append([scaled(s, 1.0 / local_size) for s in sums])
        level = nodes
    while len(level) > 1:
        level = [[adasum_pair(a, b) for a, b in zip(level[i], level[i + 1])]
                 for i in range(0, len(level), 2)]
    return [narrow(scaled(w, postscale), dtype) for w in level[0]]
