"""numba CPU kernels that reduce chunks of several ranks' data into one, scaling fused in.

The public entry point is :func:`reduce_chunks`: ``out = post * OP_k(pre * sources[k])`` with
the semantics of :mod:`mpitrain.ops.reference` (float16/bfloat16/float32 accumulate in
float32, float64 in float64, integers in their own width with C wrap-around and truncating
scale factors, bool as or/and).  Sources are combined in the order given, so a caller that
passes them in rank order gets the same bits whichever rank does the work.

Callers hand in chunks small enough to stay in cache (see :data:`CHUNK_BYTES`); the kernels
then cost one read of every source and one write of ``out`` from memory, which is the floor.

Kernels are compiled once per machine (``cache=True``) when the cache directory is writable,
lazily per element type on first use.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np

from ...dtypes import STORAGE, ReduceOp

# Chunk of one source that the algorithms reduce at a time: with p sources plus the float32
# accumulator this stays inside the 2 MiB L2 / 32 MiB L3 of the machines we measured on,
# and is large enough that per-chunk Python overhead (~10 us) stays below 1% of the time.
CHUNK_BYTES = 1 << 20

_SUM, _MIN, _MAX, _PROD = 1, 3, 4, 5
_BOOL_OP = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX,
            ReduceOp.MIN: ReduceOp.MIN, ReduceOp.PRODUCT: ReduceOp.MIN}


def _cache_usable() -> bool:
    """numba writes its cache beside the module or in NUMBA_CACHE_DIR; check it can."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return True
    here = os.path.join(os.path.dirname(__file__), "__pycache__")
    try:
        os.makedirs(here, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=here):
            pass
        return True
    except OSError:
        return False


_CACHE = _cache_usable()


def jit(fn: Callable[..., Any]) -> Any:
    """Compile ``fn`` as every CPU kernel here is: GIL released, cached on disk when usable."""
    return numba.njit(nogil=True, cache=_CACHE, fastmath=False)(fn)


# --------------------------------------------------------------- floating accumulators
@jit
def _f_init(acc, src, pre):
    for i in range(acc.size):
        acc[i] = src[i] * pre


@jit
def _f_combine(acc, src, op, pre):
    n = acc.size
    if op == _SUM:
        for i in range(n):
            acc[i] = acc[i] + src[i] * pre
    elif op == _PROD:
        for i in range(n):
            acc[i] = acc[i] * (src[i] * pre)
    elif op == _MIN:
        for i in range(n):
            x = src[i] * pre
            if x < acc[i] or x != x:  # NaN wins, as numpy.minimum
                acc[i] = x
    else:
        for i in range(n):
            x = src[i] * pre
            if x > acc[i] or x != x:
                acc[i] = x


@jit
def _f_store(out, acc, post):
    for i in range(acc.size):
        out[i] = acc[i] * post


# ------------------------------------------------------------------ integer accumulators
@jit
def _i_init(acc, src, pre, scaled):
    if scaled:
        for i in range(acc.size):
            acc[i] = np.int64(np.trunc(np.float64(src[i]) * pre))
    else:
        for i in range(acc.size):
            acc[i] = src[i]


@jit
def _i_combine(acc, src, op, pre, scaled):
    n = acc.size
    if scaled:  # rare: integer prescale; per-element conversion then the plain loops
        for i in range(n):
            x = acc.dtype.type(np.int64(np.trunc(np.float64(src[i]) * pre)))
            if op == _SUM:
                acc[i] = acc[i] + x
            elif op == _PROD:
                acc[i] = acc[i] * x
            elif op == _MIN:
                acc[i] = min(acc[i], x)
            else:
                acc[i] = max(acc[i], x)
        return
    if op == _SUM:
        for i in range(n):
            acc[i] = acc[i] + src[i]
    elif op == _PROD:
        for i in range(n):
            acc[i] = acc[i] * src[i]
    elif op == _MIN:
        for i in range(n):
            acc[i] = min(acc[i], src[i])
    else:
        for i in range(n):
            acc[i] = max(acc[i], src[i])


@jit
def _i_store(out, acc, post, scaled):
    if scaled:
        for i in range(acc.size):
            out[i] = np.int64(np.trunc(np.float64(acc[i]) * post))
    else:
        for i in range(acc.size):
            out[i] = acc[i]


# ---------------------------------------------------------------------------- bfloat16
@jit
def bf16_widen(src, dst):
    """bfloat16 bits (uint16) -> float32, exact."""
    bits = dst.view(np.uint32)
    for i in range(src.size):
        bits[i] = np.uint32(src[i]) << np.uint32(16)


@jit
def bf16_narrow(src, dst):
    """float32 -> bfloat16 bits, round to nearest even; NaN becomes the quiet NaN 0x7FC0."""
    bits = src.view(np.uint32)
    for i in range(src.size):
        x = src[i]
        if x != x:
            dst[i] = np.uint16(0x7FC0)
        else:
            b = bits[i]
            b = b + (((b >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF))
            dst[i] = np.uint16(b >> np.uint32(16))


# ------------------------------------------------------------------------ entry point
def acc_dtype(dtype: str) -> np.dtype:
    """The element type reductions of ``dtype`` accumulate in (bool: uint8)."""
    if dtype in ("float16", "bfloat16", "float32"):
        return np.dtype(np.float32)
    if dtype == "float64":
        return np.dtype(np.float64)
    if dtype == "bool":
        return np.dtype(np.uint8)
    return STORAGE[dtype]


def _widened(src: np.ndarray, dtype: str, tmp: np.ndarray) -> np.ndarray:
    if dtype == "bfloat16":
        bf16_widen(src, tmp)
        return tmp
    if dtype == "float16":
        np.copyto(tmp, src, casting="unsafe")
        return tmp
    return src


def reduce_chunks(out: np.ndarray, sources: Sequence[np.ndarray], dtype: str, op: ReduceOp,
                  prescale: float, postscale: float, acc: np.ndarray,
                  tmp: np.ndarray | None = None) -> None:
    """Reduce equally long ``sources`` (storage type of ``dtype``) into ``out``.

    Args:
        out: result, storage type; may be the same memory as any source.
        sources: one chunk per rank, in the order they are combined (rank order).
        dtype: logical element type name.
        op: SUM, MIN, MAX or PRODUCT (Average arrives as SUM with a postscale).
        prescale, postscale: factors fused into the pass.
        acc: scratch of at least ``out.size`` elements of :func:`acc_dtype` (``dtype``).
        tmp: for float16/bfloat16, scratch float32 of at least ``out.size`` elements.
    """
    n = out.size
    if n == 0:
        return
    a = acc[:n]
    if dtype == "bool":
        code = int(_BOOL_OP[op])
        srcs = [s.view(np.uint8) for s in sources]
        _i_init(a, srcs[0], 1.0, False)
        for s in srcs[1:]:
            _i_combine(a, s, code, 1.0, False)
        _i_store(out.view(np.uint8), a, 1.0, False)
        return
    code = int(op)
    if a.dtype.kind == "f":
        t = a.dtype.type
        pre, post = t(prescale), t(postscale)
        w = tmp[:n] if tmp is not None else None
        if dtype in ("float16", "bfloat16") and w is None:
            raise ValueError(f"reduce_chunks needs a float32 tmp for {dtype}")
        _f_init(a, _widened(sources[0], dtype, w), pre)  # type: ignore[arg-type]
        for s in sources[1:]:
            _f_combine(a, _widened(s, dtype, w), code, pre)  # type: ignore[arg-type]
        if dtype == "bfloat16":
            if postscale != 1.0:
                _f_store(a, a, post)
            bf16_narrow(a, out)
        elif dtype == "float16":
            if postscale != 1.0:
                _f_store(a, a, post)
            np.copyto(out, a, casting="unsafe")
        else:
            _f_store(out, a, post)
        return
    pre_scaled, post_scaled = prescale != 1.0, postscale != 1.0
    _i_init(a, sources[0], float(prescale), pre_scaled)
    for s in sources[1:]:
        _i_combine(a, s, code, float(prescale), pre_scaled)
    _i_store(out, a, float(postscale), post_scaled)


def scale_into(out: np.ndarray, src: np.ndarray, dtype: str, factor: float,
               acc: np.ndarray, tmp: np.ndarray | None = None) -> None:
    """``out = factor * src`` with the reduction's rounding (a reduction of one source)."""
    reduce_chunks(out, [src], dtype, ReduceOp.SUM, factor, 1.0, acc, tmp)


def widen_into(dst: np.ndarray, src: np.ndarray, dtype: str, factor: float) -> None:
    """``dst`` (float32) = ``factor`` * widened ``src`` (float16 or bfloat16 storage)."""
    _widened(src, dtype, dst)
    if factor != 1.0:
        _f_store(dst, dst, np.float32(factor))


def narrow_into(dst: np.ndarray, src: np.ndarray, dtype: str) -> None:
    """``dst`` (float16 or bfloat16 storage) = ``src`` (float32) rounded to nearest even."""
    if dtype == "bfloat16":
        bf16_narrow(src, dst)
    else:
        np.copyto(dst, src, casting="unsafe")


_warm: set[str] = set()


def warm_up(dtypes: Sequence[str] = ("float32",)) -> None:
    """Compile (or load from cache) the kernels for ``dtypes`` now rather than mid-collective."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", numba.NumbaWarning)
        for dtype in dtypes:
            if dtype in _warm:
                continue
            _warm.add(dtype)
            x = np.zeros(4, dtype=STORAGE[dtype])
            acc = np.empty(4, dtype=acc_dtype(dtype))
            tmp = np.empty(4, dtype=np.float32)
            for op in (ReduceOp.SUM, ReduceOp.MIN):
                reduce_chunks(x.copy(), [x, x], dtype, op, 1.0, 2.0, acc, tmp)
