"""numba CPU kernels of Adasum: per-tensor dot products and norms, and the pairwise combination.

Adasum combines two gradients ``a`` and ``b`` of one tensor as

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021): the sum
when ``a`` and ``b`` are orthogonal, their average when they are parallel.  A fused buffer
holds several tensors back to back; each tensor gets its own dot product and norms, so the
kernels take the tensor boundaries (``bounds``: ``bounds[t]`` to ``bounds[t + 1]`` is tensor
``t``, an empty range where this rank holds none of it).

Both kernels work on float32 or float64 buffers (float16 and bfloat16 are widened to float32
by the caller); sums of products accumulate in float64 and the combination is computed in
float64 and rounded once to the buffer's type, as Horovod's CPU kernels do.  A squared norm
below ``sqrt(DBL_MIN)`` counts as zero: that vector's coefficient is 1, so ``Adasum(a, 0)`` is
``a`` (a rank that joined early, contributing zeros, changes nothing).
"""

from __future__ import annotations

import math
import sys

import numpy as np

from .cpu import jit

# Horovod's threshold: a squared norm this small is treated as a zero vector.
TINY_NORM_SQ = math.sqrt(sys.float_info.min)


@jit
def _dots(a, b, bounds, out):
    for t in range(bounds.size - 1):
        dot = 0.0
        aa = 0.0
        bb = 0.0
        for i in range(bounds[t], bounds[t + 1]):
            x = np.float64(a[i])
            y = np.float64(b[i])
            dot += x * y
            aa += x * x
            bb += y * y
        out[3 * t] = dot
        out[3 * t + 1] = aa
        out[3 * t + 2] = bb


@jit
def _combine(a, b, bounds, sums, tiny):
    for t in range(bounds.size - 1):
        dot = sums[3 * t]
        aa = sums[3 * t + 1]
        bb = sums[3 * t + 2]
        ca = 1.0 - dot / aa * 0.5 if aa >= tiny else 1.0
        cb = 1.0 - dot / bb * 0.5 if bb >= tiny else 1.0
        for i in range(bounds[t], bounds[t + 1]):
            a[i] = ca * np.float64(a[i]) + cb * np.float64(b[i])


def _check(a: np.ndarray, b: np.ndarray, bounds: np.ndarray) -> None:
    if a.dtype != b.dtype or a.dtype not in (np.float32, np.float64):
        raise TypeError(f"Adasum kernels take two float32 or two float64 buffers, got "
                        f"{a.dtype} and {b.dtype}")
    if bounds.dtype != np.int64 or bounds.size < 1:
        raise TypeError("bounds must be a non-empty int64 array of tensor boundaries")
    if a.size < bounds[-1] or b.size < bounds[-1]:
        raise ValueError(f"bounds end at {int(bounds[-1])} but the buffers hold {a.size} and "
                         f"{b.size} elements")


def dot_and_norms(a: np.ndarray, b: np.ndarray, bounds: np.ndarray,
                  out: np.ndarray | None = None) -> np.ndarray:
    """Per tensor ``t``: ``[a.b, |a|^2, |b|^2]`` over ``bounds[t]:bounds[t + 1]``.

    Args:
        a, b: equally typed float32/float64 buffers.
        bounds: int64 tensor boundaries (non-decreasing), ``len(bounds) - 1`` tensors.
        out: float64 array of ``3 * (len(bounds) - 1)`` to fill (allocated when omitted).

    Returns:
        ``out``, laid out ``[dot_0, aa_0, bb_0, dot_1, ...]``.
    """
    _check(a, b, bounds)
    n = 3 * (bounds.size - 1)
    if out is None:
        out = np.empty(n, dtype=np.float64)
    elif out.dtype != np.float64 or out.size < n:
        raise ValueError(f"out must be float64 with at least {n} elements")
    _dots(a, b, bounds, out)
    return out


def combine(a: np.ndarray, b: np.ndarray, bounds: np.ndarray, sums: np.ndarray) -> None:
    """``a = ca * a + cb * b`` per tensor, with the coefficients of the summed ``sums``.

    Args:
        a: overwritten with the combination.
        b: the other gradient's values for the same elements.
        bounds: tensor boundaries as for :func:`dot_and_norms`.
        sums: per tensor ``[a.b, |a|^2, |b|^2]`` over the *whole* tensor (every rank's part
            summed), float64.
    """
    _check(a, b, bounds)
    if sums.dtype != np.float64 or sums.size < 3 * (bounds.size - 1):
        raise ValueError(f"sums must be float64 with {3 * (bounds.size - 1)} elements")
    _combine(a, b, bounds, sums, TINY_NORM_SQ)


def warm_up() -> None:
    """Compile (or load from cache) the kernels now rather than in the first collective."""
    for dt in (np.float32, np.float64):
        x = np.ones(2, dtype=dt)
        bounds = np.array([0, 2], dtype=np.int64)
        combine(x, x.copy(), bounds, dot_and_norms(x, x, bounds))
