"""numba.cuda kernels of the fixed-point sum (``MPITRAIN_DETERMINISTIC=fixed-point``).

The arithmetic of :mod:`mpitrain.ops.fixed_point` on the device, bit for bit what the CPU
kernels give: values are loaded and prescaled by :mod:`.kernels`' loaders (one float32
multiplication, or float64's), exponents come from ``frexp`` (equal to the biased exponent
field: ``k + 126`` for float32, ``k + 1022`` for float64, 0 for zeros and subnormals), the
powers of two are ``ldexp(1.0, k)`` (the CPU builds them from their bits) multiplied in the
CPU kernels' order (float64 in two halves, whose product can overflow to infinity as IEEE
multiplication does, where ``ldexp`` of the sum would raise in the simulator), and results
are stored by :mod:`.kernels`' storers.  Every product is
by a power of two or is not added to anything, so the fused multiply-adds NVVM may form
change no bit.

Each kernel is plain Python run by numba's CUDA simulator in CI and compiled ahead of time
for sm_80/sm_90 by the PTX check (:func:`kernels` lists them for it).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from ...core.dtypes import STORAGE
from .. import fixed_point as spec
from ..kernels.fixed_point import INF_SHIFT, SPECIAL32, SPECIAL64, special_count
from . import kernels
from .helpers import device_helper
from .kernels import cuda  # noqa: F401 - the name the simulator swaps inside the kernels below

_POS_MASK = (1 << INF_SHIFT) - 1


class Variant(NamedTuple):
    """One kernel as launched: its step, the element type, and its arrays' numpy types."""

    step: str  # exponents | encode | decode
    dtype: str
    arrays: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"fixed-point {self.step} {self.dtype} on {','.join(self.arrays)}"


def variants() -> list[Variant]:
    """Every fixed-point kernel the device data plane launches (for the PTX check)."""
    out = []
    for dtype, lay in spec.LAYOUTS.items():
        arr, exps, word = STORAGE[dtype].name, STORAGE[lay.exps].name, STORAGE[lay.word].name
        out += [Variant("exponents", dtype, (arr, exps)),
                Variant("encode", dtype, (arr, exps, word)),
                Variant("decode", dtype, (word, exps, arr))]
    return out


def python_function(variant: Variant) -> Any:
    """The Python function numba compiles for ``variant``."""
    factory = {"exponents": exponents_kernel, "encode": encode_kernel,
               "decode": decode_kernel}[variant.step]
    return factory(variant.dtype).py_func


def signature(variant: Variant) -> str:
    """The signature numba compiles at launch: 1-d arrays, the count (int64), the scale."""
    arrays = ", ".join(f"{a}[::1]" for a in variant.arrays)
    return f"void({arrays}, int64, float64)"


def _wide(dtype: str) -> bool:
    return dtype == "float64"


def _exponent_layout(wide: bool) -> tuple[int, int]:
    """(the exponent field of an infinity or NaN, the bias) of float64 (``wide``) or float32."""
    return (SPECIAL64, 1022) if wide else (SPECIAL32, 126)


@functools.cache
def _count_special() -> Any:
    """The CPU kernels' :func:`~mpitrain.ops.kernels.fixed_point.special_count`, on the device."""
    types = kernels.device_types()
    return device_helper(lambda v: types.int64)(special_count)


@functools.cache
def _pow2() -> Any:
    types = kernels.device_types()

    @device_helper(lambda k: types.float64)
    def pow2(k: Any) -> Any:
        return math.ldexp(1.0, k)  # exact for -1022 <= k <= 1023

    return pow2


@functools.cache
def _field(wide: bool) -> Any:
    """The biased exponent field of a value, through frexp (no bit reinterpretation)."""
    types = kernels.device_types()
    special, bias = _exponent_layout(wide)

    @device_helper(lambda v: types.int64)
    def field(v: Any) -> Any:
        if v != v or v == math.inf or v == -math.inf:
            return np.int64(special)
        if v == 0:
            return np.int64(0)
        _m, k = math.frexp(v)
        biased = np.int64(k) + bias
        return biased if biased > 0 else np.int64(0)  # subnormals: field 0

    return field


@functools.cache
def exponents_kernel(dtype: str) -> Any:
    """exps[i] = exponent field of the prescaled src[i].  ``kernel(src, exps, n, pre)``."""
    load, field = kernels.loader(dtype), _field(_wide(dtype))

    def kernel(src: Any, exps: Any, n: Any, pre: Any) -> None:
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < n:
            exps[i] = field(load(src, i, pre))
            i += stride

    return kernels.jit(kernel)


@functools.cache
def encode_kernel(dtype: str) -> Any:
    """words = the prescaled src on the agreed exponents.  ``kernel(src, exps, words, n, pre)``;
    float64 writes two words per element (hi, lo) next to each other."""
    frac, wide = spec.LAYOUTS[dtype].frac_bits, _wide(dtype)
    load, count, pow2 = kernels.loader(dtype), _count_special(), _pow2()
    special, bias = _exponent_layout(wide)

    def kernel(src: Any, exps: Any, words: Any, n: Any, pre: Any) -> None:
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < n:
            v = load(src, i, pre)
            b = np.int64(exps[i])
            e = int(b if b > 1 else 1) - bias  # |v| < 2**e on every rank
            if wide:
                if b == special:
                    words[2 * i] = count(v)
                    words[2 * i + 1] = 0
                else:
                    k = frac - e
                    half = k // 2
                    w = np.float64(v) * pow2(half) * pow2(k - half)
                    whole = math.floor(w)
                    words[2 * i] = np.int64(whole)
                    words[2 * i + 1] = np.int64(math.floor((w - whole) * pow2(frac) + 0.5))
            elif b == special:
                words[i] = count(v)
            else:
                w = np.float64(v) * pow2(frac - e)
                words[i] = np.int64(math.floor(w + 0.5))
            i += stride

    return kernels.jit(kernel)


@functools.cache
def decode_kernel(dtype: str) -> Any:
    """out = the summed words back in ``dtype``, postscaled.  ``kernel(words, exps, out, n,
    post)``."""
    frac, wide = spec.LAYOUTS[dtype].frac_bits, _wide(dtype)
    store, pow2 = kernels.storer(dtype), _pow2()
    special, bias = _exponent_layout(wide)

    def kernel(words: Any, exps: Any, out: Any, n: Any, post: Any) -> None:
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < n:
            b = np.int64(exps[i])
            k = int(b if b > 1 else 1) - bias - frac
            s = np.int64(words[2 * i]) if wide else np.int64(words[i])
            if b == special:
                pos, neg = s & _POS_MASK, s >> INF_SHIFT
                if pos > 0 and neg == 0:
                    value = math.inf
                elif neg > 0 and pos == 0:
                    value = -math.inf
                else:
                    value = math.nan
                store(out, i, value, 1.0)
            elif wide:
                low = np.int64(words[2 * i + 1])
                carry = low >> frac
                whole = s + carry
                rem = low - (carry << frac)
                a = np.float64(whole)
                t = np.float64(whole - np.int64(a)) + np.float64(rem) * pow2(-frac)
                half = k // 2
                store(out, i, (a + t) * pow2(half) * pow2(k - half) * post, 1.0)
            else:
                store(out, i, np.float64(s) * pow2(k) * post, 1.0)
            i += stride

    return kernels.jit(kernel)

