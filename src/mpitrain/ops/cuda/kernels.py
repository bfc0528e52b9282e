"""numba.cuda kernels: elementwise reductions with fused scaling, and fp16/bf16 casts.

The semantics are :mod:`mpitrain.ops.reference`'s, bit for bit in the simulator and, on a GPU,
in integer types, Min/Max/Product and casts (NaN payloads aside: a GPU makes its canonical NaN);
a floating Sum becomes one FMA, ``fma(a, prescale, b * prescale)``, equal to the reference when
prescale is 1 and within one rounding otherwise (the PTX checks of :mod:`.ptx`'s CI test pin
this down).  float16/bfloat16/float32 accumulate in float32 (float64 in float64), ``prescale``
multiplies each input as it is read, ``postscale`` the result as it is written; integers reduce
in their own width and a scale other than 1 multiplies in float64 and truncates toward zero
after each step, as the reference does.

A reduction over k buffers is k-1 launches of one two-input kernel (``combine``): the first
reads two storage buffers, the middle ones update a float32 accumulator, the last narrows into
the output.  Each launch streams its inputs once, so its bound is memory bandwidth, and
two inputs (the local and the received chunk) is the common case, done in one launch.  That
plan, as data every launch path follows, is :mod:`.kernel_steps`.

The kernel bodies are plain Python that numba's CUDA simulator runs unchanged
(``NUMBA_ENABLE_CUDASIM=1``), which is how CI tests them without a GPU.  The one primitive the
simulator lacks, reinterpreting float32 bits (for bfloat16), is chosen at import: libdevice on a
GPU, a numpy view in the simulator.

The load/store/op helpers are :func:`.helpers.device_helper` functions rather than
``cuda.jit(device=True)`` dispatchers, so every kernel here also compiles ahead of time for an
explicit compute capability with no GPU or driver (``numba.cuda.compile_ptx(..., cc=(9, 0))``);
:mod:`.ptx` compiles them all that way and CI checks the generated code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import types as numba_types

from ...core.dtypes import STORAGE, ReduceOp
from ..reduction import Reduction
from .helpers import device_helper
from .kernel_steps import Step, cast_step, reduce_steps, step_buffers
from .probe import CudaUnavailableError

cuda: Any
try:
    import numba.cuda as cuda  # the simulator swaps this module-level name inside kernels
    from numba import config as _numba_config
except Exception:  # noqa: BLE001 - numba missing or without CUDA support: no kernels here
    cuda = None
    _SIMULATED = False
else:
    _SIMULATED = bool(getattr(_numba_config, "ENABLE_CUDASIM", False))
    # A small bucket gets a small grid on purpose; numba's "Grid size N will likely result in
    # GPU under-utilization" warning then floods every training log (seen in BERT runs on an
    # H100).  Silenced unless the user asked for it through numba's own variable.
    # numba-cuda reads it from numba.cuda.core.config, which some versions keep apart.
    if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
        for _config_name in ("numba.core.config", "numba.cuda.core.config"):
            with contextlib.suppress(ImportError):
                _config: Any = importlib.import_module(_config_name)
                _config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

THREADS = 256
MAX_BLOCKS = 4096  # grid-stride beyond this: enough blocks to fill any current GPU

# The simulator runs one kernel at a time per process; channels launch from several threads.
_launching: Any = threading.Lock() if _SIMULATED else contextlib.nullcontext()


def _require_numba() -> Any:
    if cuda is None:
        raise CudaUnavailableError("mpitrain's CUDA kernels need numba with CUDA support "
                                   "(pip install numba-cuda)")
    return cuda


def launch_shape(n: int, threads: int = THREADS, max_blocks: int = MAX_BLOCKS) -> tuple[int, int]:
    """(blocks, threads) for an n-element grid-stride kernel; at least one block."""
    blocks = max(1, min(max_blocks, (n + threads - 1) // threads))
    return blocks, threads


# --------------------------------------------------------------- element load/store helpers
# Each helper is a device helper (typed by the rule given, compiled into the calling kernel);
# the factories below pick them in Python by dtype, so every compiled kernel sees only code that
# types for its arrays.

def _numba_types() -> Any:
    _require_numba()
    return numba_types


def _same(a: Any, b: Any) -> Any:
    return a if a == b else None


def _define_helpers() -> dict[Any, Any]:
    types = _numba_types()
    stores = device_helper(lambda out, i, value, scale: types.none)
    ops = device_helper(_same)
    if _SIMULATED:
        def bits_to_f32(bits: Any) -> Any:
            return np.array([bits], dtype=np.uint32).view(np.float32)[0]

        def f32_to_bits(value: Any) -> Any:
            return np.array([value], dtype=np.float32).view(np.uint32)[0]
    else:
        from numba.cuda import libdevice  # optional numba.cuda, present: _require_numba passed

        def bits_to_f32(bits: Any) -> Any:
            return libdevice.int_as_float(np.int32(bits))

        def f32_to_bits(value: Any) -> Any:
            return np.uint32(libdevice.float_as_int(value)) & np.uint32(0xFFFFFFFF)

    bits_to_f32 = device_helper(lambda bits: types.float32)(bits_to_f32)
    f32_to_bits = device_helper(lambda value: types.uint32)(f32_to_bits)

    @device_helper(lambda a, i, scale: types.float32)
    def load_bf16(a: Any, i: Any, scale: Any) -> Any:
        return bits_to_f32(np.uint32(a[i]) << np.uint32(16)) * np.float32(scale)

    @device_helper(lambda a, i, scale: types.float32)
    def load_f32(a: Any, i: Any, scale: Any) -> Any:
        return np.float32(a[i]) * np.float32(scale)

    @device_helper(lambda a, i, scale: types.float64)
    def load_f64(a: Any, i: Any, scale: Any) -> Any:
        return np.float64(a[i]) * np.float64(scale)


    @stores
    def store_bf16(out: Any, i: Any, value: Any, scale: Any) -> None:
        v = np.float32(value) * np.float32(scale)
        if v != v:  # NaN stays a quiet NaN
            out[i] = np.uint16(0x7FC0)
            return
        bits = f32_to_bits(v)
        rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
        # numba types uint32 + uint32 as 64-bit: narrowing the sum (not masking it) lets the
        # add stay 32-bit in PTX; the value is the same (a finite float's bits + 0x8000 at
        # most never carry out of 32 bits, and the mask dropped the carry anyway).
        out[i] = np.uint16(np.uint32(bits + rounding) >> np.uint32(16))

    @stores
    def store_f32(out: Any, i: Any, value: Any, scale: Any) -> None:
        out[i] = np.float32(value) * np.float32(scale)

    @stores
    def store_f64(out: Any, i: Any, value: Any, scale: Any) -> None:
        out[i] = np.float64(value) * np.float64(scale)

    @ops
    def op_sum(a: Any, b: Any) -> Any:
        return a + b

    # A NaN from either side wins, as in numpy.minimum/maximum (the reference) and the CPU
    # kernels.  Not min()/max(): Python's keep ``a`` when ``b`` is NaN, and on a GPU numba
    # lowers them to fminf/fmaxf, which drop NaN from both sides.
    @ops
    def op_min(a: Any, b: Any) -> Any:
        return b if b < a or b != b else a

    @ops
    def op_max(a: Any, b: Any) -> Any:
        return b if b > a or b != b else a

    @ops
    def op_prod(a: Any, b: Any) -> Any:
        return a * b

    return {"load_bf16": load_bf16, "load_f32": load_f32, "load_f64": load_f64,
            "store_bf16": store_bf16, "store_f32": store_f32, "store_f64": store_f64,
            ReduceOp.SUM: op_sum, ReduceOp.MIN: op_min,
            ReduceOp.MAX: op_max, ReduceOp.PRODUCT: op_prod}


@functools.lru_cache(maxsize=1)
def _helpers() -> dict[Any, Any]:
    return _define_helpers()


# The float helpers of each element kind, by the float type it is loaded and stored as
# (accumulators, ``acc32``/``acc64``, included); an integer kind has its own (_int_helpers).
_FLOAT_HELPERS = {"bfloat16": "bf16", "float16": "f32", "float32": "f32", "acc32": "f32",
                  "float64": "f64", "acc64": "f64"}


def _helper_for(kind: str, verb: str) -> Any:
    """The device helper that loads (``verb`` "load") or stores ("store") elements of ``kind``."""
    width = _FLOAT_HELPERS.get(kind)
    if width is not None:
        return _helpers()[f"{verb}_{width}"]
    load, store = _int_helpers(STORAGE[kind].itemsize * 8, STORAGE[kind].kind == "i")
    return load if verb == "load" else store


@functools.cache
def _int_helpers(bits: int, signed: bool) -> tuple[Any, Any]:
    """Integer load and store, scaled as the reference scales: in float64, truncated toward
    zero, then wrapped to the storage width (so Min/Max compare what the reference compares
    and stores wrap as C does, on the GPU and in the simulator alike)."""
    types = _numba_types()
    # Constants numba can type (64-bit values never wrap, so never use them).
    modulus = 1 << bits if bits < 64 else 1
    half = 1 << (bits - 1) if bits < 64 else 0

    @device_helper(lambda v: types.int64)
    def wrap(v: Any) -> Any:
        if bits == 64:
            return v
        if signed:
            return (v + half) % modulus - half
        return v % modulus

    @device_helper(lambda a, i, scale: types.int64)
    def load_int(a: Any, i: Any, scale: Any) -> Any:
        if scale == 1.0:
            return np.int64(a[i])
        return wrap(np.int64(np.float64(a[i]) * np.float64(scale)))

    @device_helper(lambda out, i, value, scale: types.none)
    def store_int(out: Any, i: Any, value: Any, scale: Any) -> None:
        v = wrap(np.int64(value))
        if scale != 1.0:
            v = wrap(np.int64(np.float64(v) * np.float64(scale)))
        out[i] = v

    return load_int, store_int


# ----------------------------------------------------------------------------- kernels
@functools.cache
def combine_kernel(kind_a: str, kind_b: str, kind_out: str, op: ReduceOp) -> Any:
    """out[i] = store(op(load(a[i]) * scale_a, load(b[i]) * scale_b)) * scale_out.

    ``kind_*`` is a logical dtype name, or ``acc32``/``acc64`` for an accumulator buffer.
    Called as ``kernel[blocks, threads, stream](a, b, out, n, scale_a, scale_b, scale_out)``.
    """
    numba_cuda = _require_numba()
    load_a, load_b, store, combine = loader(kind_a), loader(kind_b), storer(kind_out), \
        _helpers()[op]

    def kernel(a: Any, b: Any, out: Any, n: Any, scale_a: Any, scale_b: Any,
               scale_out: Any) -> None:
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < n:
            store(out, i, combine(load_a(a, i, scale_a), load_b(b, i, scale_b)), scale_out)
            i += stride

    return numba_cuda.jit(kernel)


@functools.cache
def scale_kernel(kind_in: str, kind_out: str) -> Any:
    """out[i] = store(load(a[i]) * scale_in) * scale_out: casts, copies and lone scalings.

    The fp16/bf16 compression casts are ``scale_kernel("float32", "float16")`` and back.
    """
    numba_cuda = _require_numba()
    load, store = loader(kind_in), storer(kind_out)

    def kernel(a: Any, out: Any, n: Any, scale_in: Any, scale_out: Any) -> None:
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < n:
            store(out, i, load(a, i, scale_in), scale_out)
            i += stride

    return numba_cuda.jit(kernel)


def step_kernel(step: Step) -> Any:
    """The numba kernel (dispatcher) of ``step``."""
    if step.family == "combine":
        assert step.op is not None
        kind_a, kind_b, kind_out = step.kinds
        return combine_kernel(kind_a, kind_b, kind_out, step.op)
    return scale_kernel(*step.kinds)


@dataclass(frozen=True)
class LaunchConfig:
    """Where a launch through numba's dispatch goes, and its grid (tests narrow it to reach
    the grid-stride loop and ragged tails)."""

    stream: Any = 0  # a numba stream
    threads: int | None = None  # per block; None: THREADS
    max_blocks: int | None = None  # None: MAX_BLOCKS


_DEFAULT_LAUNCH = LaunchConfig()


def launch_step(step: Step, buffers: list[Any], n: int,
                on: LaunchConfig = _DEFAULT_LAUNCH) -> None:
    """Launch ``step`` over ``n`` elements of numba arrays (or anything numba accepts) through
    numba's dispatch."""
    blocks, threads = launch_shape(n, on.threads or THREADS, on.max_blocks or MAX_BLOCKS)
    with _launching:  # in the simulator, also while compiling: a running kernel swaps `cuda`
        step_kernel(step)[blocks, threads, on.stream](*buffers, n, *step.scales)


def reduce_buffers(inputs: list[Any], out: Any, how: Reduction, scratch: Any,
                   on: LaunchConfig = _DEFAULT_LAUNCH) -> None:
    """Reduce equally long device buffers into ``out`` (which may be one of them).

    Args:
        inputs: storage-typed device arrays (numba device arrays, or anything numba accepts).
        out: the storage-typed output.
        how: logical element type, factors, and op: SUM/MIN/MAX/PRODUCT (Average arrives as
            Sum).
        scratch: an accumulator array of ``accumulator_dtype(dtype)`` and the same length,
            used only when there are more than two inputs.
    """
    n = int(out.shape[0])
    for step in reduce_steps(len(inputs), how.dtype, how.op, how.prescale, how.postscale):
        launch_step(step, step_buffers(step, inputs, out, scratch), n, on)


def cast(src: Any, out: Any, dtype_in: str, dtype_out: str, scale: float = 1.0,
         on: LaunchConfig = _DEFAULT_LAUNCH) -> None:
    """Convert ``src`` to ``out`` (fp16/bf16 compression and back), times ``scale``."""
    launch_step(cast_step(dtype_in, dtype_out, scale), [src, out], int(src.shape[0]), on)


def loader(kind: str) -> Any:
    """The device helper ``load(a, i, scale)`` of :func:`combine_kernel` for arrays of
    ``kind``: element i in its accumulation type, times ``scale`` (other kernels reuse it)."""
    return _helper_for(kind, "load")


def storer(kind: str) -> Any:
    """The device helper ``store(out, i, value, scale)`` for arrays of ``kind``."""
    return _helper_for(kind, "store")


def device_types() -> Any:
    """numba's types module, once numba.cuda is known to be there (for device helpers)."""
    return _numba_types()


def jit(kernel: Any) -> Any:
    """Compile ``kernel`` with numba.cuda as every kernel here is (raising without it)."""
    return _require_numba().jit(kernel)


def launch(kernel: Any, n: int, stream: Any, *args: Any) -> None:
    """Launch a grid-stride ``kernel`` over ``n`` elements on ``stream`` (a numba stream)."""
    blocks, threads = launch_shape(n)
    with _launching:
        kernel[blocks, threads, stream](*args)


def simulated() -> bool:
    """True when numba runs kernels in its CUDA simulator (NUMBA_ENABLE_CUDASIM=1)."""
    return _SIMULATED


__all__ = ["LaunchConfig", "cast", "combine_kernel", "device_types", "jit", "launch",
           "launch_shape", "launch_step", "loader", "reduce_buffers", "scale_kernel", "simulated",
           "step_kernel", "storer"]
