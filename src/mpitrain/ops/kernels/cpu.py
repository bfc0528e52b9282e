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

import functools
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba.extending import intrinsic

from ...core.dtypes import STORAGE, ReduceOp
from ..reduction import Reduction

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
def _f_scale(dst, src, factor):
    """dst = src * factor: the first source into the accumulator, or the accumulator out."""
    for i in range(dst.size):
        dst[i] = src[i] * factor


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


# ------------------------------------------------------------------ integer accumulators
@jit
def _i_scale(dst, src, factor, scaled):
    """dst = src, times ``factor`` in float64 truncated toward zero where ``scaled``: the first
    source into the accumulator, or the accumulator out (wrapping to the storage width)."""
    if scaled:
        for i in range(dst.size):
            dst[i] = np.int64(np.trunc(np.float64(src[i]) * factor))
    else:
        for i in range(dst.size):
            dst[i] = src[i]


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


# ----------------------------------------------------------------------------- float16
# numba has no float16 type on the CPU, and numpy's float16 casts run at ~1 and ~0.5 G
# elements/s here (8M elements: 9.4 ms widening, 17 ms narrowing), which made float16
# allreduces three times as dear as float32 ones in CPU time.  LLVM's own half conversions
# (fpext/fptrunc, which become vcvtph2ps/vcvtps2ph on x86 with F16C) run at memory speed
# (2.6 and 2.0 ms).  They round like numpy (to nearest even, overflow to infinity); the one
# difference: a signalling NaN comes out quiet (in either direction; its sign and payload's
# top bits kept), as with torch's conversions.
@intrinsic
def _half_to_float(typingctx: Any, bits: Any) -> Any:
    """uint16 holding IEEE half bits -> float32 (exact)."""
    if bits != numba.types.uint16:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())

    return numba.types.float32(numba.types.uint16), codegen


@intrinsic
def _float_to_half(typingctx: Any, x: Any) -> Any:
    """float32 -> IEEE half bits in a uint16, rounded to nearest even."""
    if x != numba.types.float32:
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], llvm_ir.HalfType()), llvm_ir.IntType(16))

    return numba.types.uint16(numba.types.float32), codegen


@jit
def _f16_widen(src, dst):
    """float16 bits (uint16) -> float32."""
    for i in range(src.size):
        dst[i] = _half_to_float(src[i])  # type: ignore[call-arg] # numba supplies typingctx


@jit
def _f16_narrow(src, dst):
    """float32 -> float16 bits (uint16), round to nearest even."""
    for i in range(src.size):
        dst[i] = _float_to_half(src[i])  # type: ignore[call-arg] # numba supplies typingctx


def _hardware_half_works() -> bool:
    """Compile and check the LLVM half conversions once; numpy's casts stand in if they fail
    (an LLVM without a lowering for this CPU would leave an unresolved helper symbol)."""
    try:
        probe = np.array([1.0, -2.5, 65504.0, 6e-8, np.inf], dtype=np.float16)
        wide = np.empty(probe.size, np.float32)
        _f16_widen(probe.view(np.uint16), wide)
        back = np.empty(probe.size, np.uint16)
        _f16_narrow(wide, back)
        return bool(np.array_equal(wide, probe.astype(np.float32))
                    and np.array_equal(back, probe.view(np.uint16)))
    except Exception:  # noqa: BLE001 - any failure to build means: use numpy's casts
        return False


@functools.cache
def _hardware_half() -> bool:
    return _hardware_half_works()


def f16_widen(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst`` (float32) = ``src`` (float16 storage), exact."""
    if _hardware_half():
        _f16_widen(src.view(np.uint16), dst)
    else:
        np.copyto(dst, src.view(np.float16), casting="unsafe")


def f16_narrow(src: np.ndarray, dst: np.ndarray) -> None:
    """``dst`` (float16 storage) = ``src`` (float32) rounded to nearest even."""
    if _hardware_half():
        _f16_narrow(src, dst.view(np.uint16))
    else:
        with np.errstate(over="ignore"):  # overflow to infinity is the rounding asked for
            np.copyto(dst.view(np.float16), src, casting="unsafe")


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
        f16_widen(src, tmp)
        return tmp
    return src


def reduce_chunks(out: np.ndarray, sources: Sequence[np.ndarray], how: Reduction,
                  acc: np.ndarray, tmp: np.ndarray | None = None) -> None:
    """Reduce equally long ``sources`` (storage type of ``how.dtype``) into ``out``.

    Args:
        out: result, storage type; may be the same memory as any source.
        sources: one chunk per rank, in the order they are combined (rank order).
        how: element type, factors fused into the pass, and op: SUM, MIN, MAX or PRODUCT
            (Average arrives as SUM with a postscale).
        acc: scratch of at least ``out.size`` elements of :func:`acc_dtype` (``dtype``).
        tmp: for float16/bfloat16, scratch float32 of at least ``out.size`` elements.
    """
    dtype, op, prescale, postscale = how.dtype, how.op, how.prescale, how.postscale
    n = out.size
    if n == 0:
        return
    a = acc[:n]
    if dtype == "bool":
        code = int(_BOOL_OP[op])
        srcs = [s.view(np.uint8) for s in sources]
        _i_scale(a, srcs[0], 1.0, False)
        for s in srcs[1:]:
            _i_combine(a, s, code, 1.0, False)
        _i_scale(out.view(np.uint8), a, 1.0, False)
        return
    code = int(op)
    if a.dtype.kind == "f":
        t = a.dtype.type
        pre, post = t(prescale), t(postscale)
        w = tmp[:n] if tmp is not None else None
        if dtype in ("float16", "bfloat16") and w is None:
            raise ValueError(f"reduce_chunks needs a float32 tmp for {dtype}")
        _f_scale(a, _widened(sources[0], dtype, w), pre)  # type: ignore[arg-type]
        for s in sources[1:]:
            _f_combine(a, _widened(s, dtype, w), code, pre)  # type: ignore[arg-type]
        if dtype == "bfloat16":
            if postscale != 1.0:
                _f_scale(a, a, post)
            bf16_narrow(a, out)
        elif dtype == "float16":
            if postscale != 1.0:
                _f_scale(a, a, post)
            f16_narrow(a, out)
        else:
            _f_scale(out, a, post)
        return
    pre_scaled, post_scaled = prescale != 1.0, postscale != 1.0
    _i_scale(a, sources[0], float(prescale), pre_scaled)
    for s in sources[1:]:
        _i_combine(a, s, code, float(prescale), pre_scaled)
    _i_scale(out, a, float(postscale), post_scaled)


def scale_into(out: np.ndarray, src: np.ndarray, dtype: str, factor: float,
               acc: np.ndarray, tmp: np.ndarray | None = None) -> None:
    """``out = factor * src`` with the reduction's rounding (a reduction of one source)."""
    reduce_chunks(out, [src], Reduction(dtype, prescale=factor), acc, tmp)


def widen_into(dst: np.ndarray, src: np.ndarray, dtype: str, factor: float) -> None:
    """``dst`` (float32) = ``factor`` * widened ``src`` (float16 or bfloat16 storage)."""
    _widened(src, dtype, dst)
    if factor != 1.0:
        _f_scale(dst, dst, np.float32(factor))


def narrow_into(dst: np.ndarray, src: np.ndarray, dtype: str) -> None:
    """``dst`` (float16 or bfloat16 storage) = ``src`` (float32) rounded to nearest even."""
    if dtype == "bfloat16":
        bf16_narrow(src, dst)
    else:
        f16_narrow(src, dst)


_warm: set[str] = set()
# What a job most likely reduces first: float32 gradients, then the 16-bit wire types.
LIKELY_DTYPES = ("float32", "float16", "bfloat16")


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
                reduce_chunks(x.copy(), [x, x], Reduction(dtype, 1.0, 2.0, op), acc, tmp)


def warm_up_in_background(dtypes: Sequence[str] = LIKELY_DTYPES) -> threading.Thread:
    """Start :func:`warm_up` on a thread of its own and return it.

    Loading numba's cached kernels took 0.6 s in an idle process and 1.7 s with 2 ranks
    on our 2-core machines, all of it inside a job's first allreduce (its first step took
    ~2 s more than the next).  Started when the engine starts, the load overlaps what a
    script does between ``init()`` and its first step (building the model, loading data,
    broadcasting parameters).  A collective that needs a kernel still loading waits for it
    in numba's own compiler lock, no longer than before.  Not a daemon: the interpreter
    waits for it at exit rather than tearing down under LLVM's feet.
    """
    thread = threading.Thread(target=warm_up, args=(tuple(dtypes),),
                              name="mpitrain-kernel-warm-up")
    thread.start()
    # Kept only while it may still run: an elastic job starts an engine at every rebuild.
    _loading[:] = [t for t in _loading if t.is_alive()] + [thread]
    return thread


_loading: list[threading.Thread] = []


def wait_for_warm_up(timeout: float | None = None) -> None:
    """Wait until the background loads started so far are done: for measurements of the
    steady state (the load competes for the cores for a second or two after ``init()``)."""
    for thread in list(_loading):
        thread.join(timeout)
