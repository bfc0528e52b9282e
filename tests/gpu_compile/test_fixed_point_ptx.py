"""The fixed-point sum's device kernels, compiled for sm_80 and sm_90 without a GPU.

Each must assemble with no spills, no stack and full occupancy, as the reduction kernels do
(tests/gpu_compile/test_ptx_checks.py).  NVVM contracts ``x * 2**k + c`` into a fused
multiply-add in the encoders (and once in the float64 decoder); a product by a power of two
is exact in the range these kernels use it, so the fused form has the same bits, which the
simulator suite (tests/cuda_sim/test_fixed_point.py) and, on a GPU, tests/gpu check against
the CPU's numpy statement.  Here: that every fused multiply-add adds what that argument
covers (the rounding constant 0.5, or in the float64 decoder the high word's remainder).
"""

from __future__ import annotations

import re

import pytest
from numba import cuda

from mpitrain.ops.cuda import fixed_point, ptx

_FMA = re.compile(r"^\s*fma\.rn\.f64\s+(%fd\d+), (%fd\d+), (%fd\d+), (\S+);$", re.M)
HALF = "0d3FE0000000000000"  # 0.5 as PTX writes a float64 immediate


@pytest.fixture(scope="module")
def compiled():
    out = {}
    for variant in fixed_point.variants():
        for cc in ptx.CCS:
            text = cuda.compile_ptx(fixed_point.python_function(variant),
                                    fixed_point.signature(variant), cc=cc)[0]
            out[variant, cc] = (text, ptx.assemble(text, cc, variant.name))
    return out


def test_every_variant_assembles_without_spills_at_full_occupancy(compiled):
    assert len(compiled) == 12 * len(ptx.CCS)
    for (variant, cc), (text, res) in compiled.items():
        what = f"{variant.name} sm_{cc[0]}{cc[1]}: {res}"
        assert f".target sm_{cc[0]}{cc[1]}" in text, what
        assert not (res.spill_stores or res.spill_loads or res.stack_bytes), what
        assert ptx.occupancy(res.registers, cc) == 1.0, what


def test_fused_multiply_adds_only_where_the_product_is_exact(compiled):
    for (variant, cc), (text, _res) in compiled.items():
        fmas = _FMA.findall(text)
        if variant.step == "exponents" or (variant.step == "decode" and variant.dtype != "float64"):
            assert not fmas, (variant.name, cc, fmas)
        elif variant.step == "encode":
            assert all(addend == HALF for *_, addend in fmas), (variant.name, cc, fmas)
        else:  # float64's decoder: rem * 2**-49 + (whole - float(whole)), one of them
            assert len(fmas) <= 1, (variant.name, cc, fmas)
