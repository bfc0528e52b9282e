"""Every kernel the GPU data plane launches, compiled for sm_80 and sm_90 without a GPU.

Assembly by ptxas must succeed with no spills, no stack and full occupancy at the launch
block size; and the PTX must show what the CUDA simulator cannot: float16 stores round to
nearest even from float32, bfloat16 conversions move bits, float32 kernels do no 64-bit
arithmetic in their loop, Min/Max let NaN through (numba's min() on a GPU is fminf, which does
not), and fused multiply-adds occur only where the docs allow them.  Each property is also
shown to fail on a deliberately wrong kernel (the negative control).
"""

from __future__ import annotations

import numpy as np
import ptx_text
import pytest
from numba import cuda
from numba.cuda import libdevice

from mpitrain.ops.cuda import ptx

# Full occupancy: 256-thread blocks fill every thread slot of an SM, so each kernel may use at
# most 32 registers per thread on sm_80/sm_90.
MIN_OCCUPANCY = 1.0
FLOAT32_CLASS = frozenset({"float16", "uint16", "float32"})  # uint16 arrays hold bfloat16
FLOATING_KINDS = frozenset({"float16", "bfloat16", "float32", "float64", "acc32", "acc64"})


def _numba_kernels(compiled):
    return [(k, cc, c) for (k, cc), c in compiled.items() if k.family != "pack"]


def _negative(fn, signature):
    """PTX of a deliberately wrong kernel, compiled like the real ones."""
    return cuda.compile_ptx(fn, signature, cc=ptx.CCS[-1])[0]


def test_every_variant_compiled_for_every_target(compiled):
    kernels = ptx.kernels()
    assert len(kernels) > 100  # 10 dtypes x ops x plan steps, the casts and 5 pack units
    assert {cc for _, cc in compiled} == {(8, 0), (9, 0)}
    assert len(compiled) == len(kernels) * len(ptx.CCS)
    for (kernel, cc), c in compiled.items():
        assert f".target sm_{cc[0]}{cc[1]}" in c.ptx, kernel.name
        assert ".entry" in c.ptx, kernel.name


def test_no_spills_no_stack_and_full_occupancy(compiled):
    rows, bad = [], []
    for (kernel, cc), c in sorted(compiled.items(), key=lambda kv: (kv[0][0].name, kv[0][1])):
        occ = ptx.occupancy(c.registers, cc)
        rows.append(f"{kernel.name} sm_{cc[0]}{cc[1]}: {c.registers} registers, "
                    f"spills {c.spill_stores}/{c.spill_loads} B, occupancy {occ:.0%}")
        if c.spill_stores or c.spill_loads or c.stack_bytes or occ < MIN_OCCUPANCY:
            bad.append(rows[-1] + f", stack {c.stack_bytes} B")
    print("\n".join(rows))
    assert not bad, "\n".join(bad)


def test_the_occupancy_bound_has_teeth():
    assert ptx.occupancy(32, (9, 0)) == 1.0
    assert ptx.occupancy(33, (9, 0)) < MIN_OCCUPANCY
    assert ptx.occupancy(64, (8, 0)) == 0.5


# ------------------------------------------------------------------------------ float16
def test_float16_stores_round_to_nearest_even_from_float32(compiled):
    checked = 0
    for kernel, cc, c in _numba_kernels(compiled):
        if kernel.arrays[-1] == "float16":
            assert ptx_text.f16_store_problems(c.ptx) == [], (kernel.name, cc)
            checked += 1
        if "float16" in kernel.arrays[:-1]:
            assert ptx_text.f16_load_problems(c.ptx) == [], (kernel.name, cc)
    assert checked >= 10


def test_float16_store_check_fails_on_a_store_from_float64():
    def kernel(a, out, n, scale):
        i = cuda.grid(1)
        while i < n:
            out[i] = np.float64(a[i]) * scale
            i += cuda.gridsize(1)

    text = _negative(kernel, "void(float32[::1], float16[::1], int64, float64)")
    assert ptx_text.f16_store_problems(text) == ["cvt.rn.f16.f64"]


# ----------------------------------------------------------------------------- bfloat16
def test_bfloat16_conversions_reinterpret_bits(compiled):
    checked = 0
    for kernel, cc, c in _numba_kernels(compiled):
        if "uint16" in kernel.arrays:
            assert ptx_text.bit_cast_problems(c.ptx) == [], (kernel.name, cc)
            checked += 1
    assert checked >= 20


def test_bit_cast_check_fails_on_a_numeric_conversion():
    def kernel(a, out, n, scale):
        i = cuda.grid(1)
        while i < n:
            out[i] = np.float32(np.uint32(a[i]) << np.uint32(16)) * np.float32(scale)
            i += cuda.gridsize(1)

    text = _negative(kernel, "void(uint16[::1], float32[::1], int64, float64)")
    problems = ptx_text.bit_cast_problems(text)
    assert any(p.startswith("numeric conversion cvt.rn.f32.u") for p in problems), problems


# ------------------------------------------------------------------- 64-bit arithmetic
def test_float32_kernels_do_no_64bit_arithmetic_in_their_loop(compiled):
    checked = 0
    for kernel, cc, c in _numba_kernels(compiled):
        if set(kernel.arrays) <= FLOAT32_CLASS:
            assert ptx_text.wide_arithmetic_problems(c.ptx) == [], (kernel.name, cc)
            checked += 1
    assert checked >= 40


def test_wide_arithmetic_check_fails_on_float64_math_and_on_the_old_bf16_rounding():
    def f64_scaling(a, out, n, scale):
        i = cuda.grid(1)
        while i < n:
            out[i] = np.float32(a[i] * scale)  # float32 * float64 computes in float64
            i += cuda.gridsize(1)

    # The bfloat16 store before this check existed: masking a 64-bit sum kept it 64-bit.
    def masked_bf16_rounding(a, out, n, scale):
        i = cuda.grid(1)
        while i < n:
            v = a[i] * np.float32(scale)
            if v != v:
                out[i] = np.uint16(0x7FC0)
            else:
                bits = np.uint32(libdevice.float_as_int(v)) & np.uint32(0xFFFFFFFF)
                rounding = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
                out[i] = np.uint16(((bits + rounding) & np.uint32(0xFFFFFFFF))
                                   >> np.uint32(16))
            i += cuda.gridsize(1)

    f64 = ptx_text.wide_arithmetic_problems(
        _negative(f64_scaling, "void(float32[::1], float32[::1], int64, float64)"))
    assert any(p.startswith("f64 instruction") for p in f64), f64
    widened = ptx_text.wide_arithmetic_problems(
        _negative(masked_bf16_rounding, "void(float32[::1], uint16[::1], int64, float64)"))
    assert any(p.startswith("64-bit data cvt.u64.u32") for p in widened), widened


# ---------------------------------------------------------------------------------- FMA
def test_fma_only_in_floating_sum_and_only_against_a_scale(compiled):
    """The docs' promise: integer kernels, Min/Max/Product and casts are bit-exact on a GPU
    (no FMA); a floating Sum fuses ``a * prescale + b * prescale`` into one FMA, which equals
    the unfused result when the scale is 1 (``a * 1.0`` is exact) and is within one rounding
    of it otherwise."""
    fused = 0
    for kernel, cc, c in _numba_kernels(compiled):
        found = ptx_text.fmas(c.ptx)
        floating_sum = (kernel.family == "combine" and kernel.op == "SUM"
                        and set(kernel.kinds) <= FLOATING_KINDS)
        if floating_sum:
            assert found, (kernel.name, cc)
            assert ptx_text.fma_problems(c.ptx) == [], (kernel.name, cc)
            fused += 1
        else:
            assert not found, (kernel.name, cc, found)
    assert fused >= 16


def test_fma_check_fails_on_a_product_of_two_loaded_values():
    def kernel(a, b, out, n):
        i = cuda.grid(1)
        while i < n:
            out[i] = a[i] * b[i] + out[i]
            i += cuda.gridsize(1)

    text = _negative(kernel, "void(float32[::1], float32[::1], float32[::1], int64)")
    assert ptx_text.fmas(text)
    assert ptx_text.fma_problems(text)


# ------------------------------------------------------------------------------ Min/Max
def test_floating_min_and_max_let_nan_through(compiled):
    checked = 0
    for kernel, cc, c in _numba_kernels(compiled):
        if (kernel.family == "combine" and kernel.op in ("MIN", "MAX")
                and set(kernel.kinds) <= FLOATING_KINDS):
            assert ptx_text.nan_dropping_problems(c.ptx) == [], (kernel.name, cc)
            checked += 1
    assert checked >= 16


def test_nan_check_fails_on_python_min():
    def kernel(a, b, out, n):
        i = cuda.grid(1)
        while i < n:
            out[i] = min(a[i], b[i])  # numba lowers this to fminf on a GPU
            i += cuda.gridsize(1)

    text = _negative(kernel, "void(float32[::1], float32[::1], float32[::1], int64)")
    assert "min.f32 drops NaN" in ptx_text.nan_dropping_problems(text)


# --------------------------------------------------------------------------------- pack
@pytest.mark.parametrize(("unit", "access"), [(16, "v4.u32"), (8, "u64"), (4, "u32"),
                                               (2, "u16"), (1, "u8")])
def test_pack_moves_whole_copy_units(compiled, unit, access):
    kernel = next(k for k in ptx.pack_kernels() if k.kinds == (str(unit),))
    for cc in ptx.CCS:
        accesses = ptx_text.vector_accesses(compiled[kernel, cc].ptx)
        # The data moves in whole units; the other loads read the chunk table (64-bit).
        assert {a for a in accesses if a.startswith("st.")} == {f"st.global.{access}"}, accesses
        assert f"ld.global.{access}" in accesses, accesses


def test_pack_access_check_tells_units_apart(compiled):
    eight = next(k for k in ptx.pack_kernels() if k.kinds == ("8",))
    stores = {a for a in ptx_text.vector_accesses(compiled[eight, ptx.CCS[0]].ptx)
              if a.startswith("st.")}
    assert stores == {"st.global.u64"}
