"""The fixed-point sum's CUDA kernels, run by numba's CUDA simulator, against its numpy statement.

The device kernels take another route to the same arithmetic as the CPU's (``frexp`` for the
exponent field, ``ldexp`` for the powers of two): every rank's step is run here, the Max and
the Sum across ranks done by numpy, and the result held to ``fixed_point.reference`` bit for
bit, hard values included (subnormals, both zeros, the largest finite values, infinities, NaN;
NaN compared as NaN: a GPU writes its own NaN bits).
"""

import numpy as np
import pytest

from mpitrain.core.dtypes import STORAGE
from mpitrain.ops import fixed_point as spec
from mpitrain.ops import reference
from mpitrain.ops.cuda import fixed_point, kernels

N = 61
LAUNCH = (2, 8)  # two blocks of eight threads: the grid-stride loop and a ragged tail


def _hard(ranks, dtype, seed):
    rng = np.random.default_rng(seed)
    info = np.finfo(np.float32 if dtype in ("float32", "bfloat16") else dtype)
    lo, hi = np.log2(float(info.smallest_subnormal)), np.log2(float(info.max))
    out = []
    for _ in range(ranks):
        x = rng.choice([-1.0, 1.0], N) * 2.0 ** rng.uniform(lo, hi, N)
        x[:10] = [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max),
                  float(info.smallest_subnormal), float(info.tiny), 1.0]
        x[10:30] = rng.normal(size=20)  # near 1 on every rank: sums that cancel
        rng.shuffle(x)
        if dtype == "bfloat16":
            out.append(reference.f32_to_bf16(x.astype(np.float32)))
        else:
            with np.errstate(over="ignore"):
                out.append(x.astype(STORAGE[dtype]))
    return out


def _device_sum(inputs, dtype, pre, post):
    lay = spec.LAYOUTS[dtype]
    fields = []
    for x in inputs:
        e = np.empty(N, STORAGE[lay.exps])
        fixed_point.exponents_kernel(dtype)[LAUNCH](x, e, N, pre)
        fields.append(e)
    agreed = np.maximum.reduce(fields)
    total = np.zeros(N * lay.words, STORAGE[lay.word])
    for x in inputs:
        w = np.empty(N * lay.words, STORAGE[lay.word])
        fixed_point.encode_kernel(dtype)[LAUNCH](x, agreed, w, N, pre)
        total += w
    out = np.empty(N, STORAGE[dtype])
    fixed_point.decode_kernel(dtype)[LAUNCH](total, agreed, out, N, post)
    return out


def _same(got, want, dtype):
    wide = reference.widen(got, dtype).astype(np.float64)
    nan = np.isnan(wide)
    assert (nan == np.isnan(reference.widen(want, dtype).astype(np.float64))).all()
    assert got[~nan].tobytes() == want[~nan].tobytes()


def test_runs_in_the_simulator():
    assert kernels.simulated()


@pytest.mark.parametrize("dtype", list(spec.LAYOUTS))
@pytest.mark.parametrize(("pre", "post"), [(1.0, 1.0), (0.3, 0.25)])
def test_device_kernels_give_the_numpy_statements_bits(dtype, pre, post):
    for ranks in (1, 3):
        inputs = _hard(ranks, dtype, seed=ranks)
        _same(_device_sum(inputs, dtype, pre, post),
              spec.reference(inputs, dtype, pre, post), dtype)


def test_every_launched_variant_is_listed_for_the_ptx_check():
    names = {v.name for v in fixed_point.variants()}
    assert len(names) == 3 * len(spec.LAYOUTS)
    for v in fixed_point.variants():
        assert fixed_point.python_function(v) is not None and "int64" in fixed_point.signature(v)
