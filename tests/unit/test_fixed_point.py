"""The fixed-point sum's CPU kernels against its numpy statement, and the properties it promises.

Ranks are simulated in one process: each rank's exponent fields and integers come from the
kernels (:mod:`mpitrain.ops.fixed_point`), the Max and the Sum across ranks from numpy, as any
exact collective would give them.  The tests over MPI (tests/mpi/test_deterministic.py) hold
the data plane to the same statement under every algorithm.
"""

from fractions import Fraction

import numpy as np
import pytest

from mpitrain.core.dtypes import STORAGE
from mpitrain.ops import fixed_point, ordered, reference
from mpitrain.ops.reduction import Reduction, check_floating
from mpitrain.ops.scratch import Scratch

FLOATS = ("float32", "float64", "float16", "bfloat16")


def simulate(inputs, dtype, pre=1.0, post=1.0):
    """Every rank's kernels, the collectives done by numpy (Max, wrapping Sum)."""
    how = Reduction(dtype, pre, post)
    lay = fixed_point.LAYOUTS[dtype]
    n = inputs[0].size
    fields = []
    for x in inputs:
        e = np.empty(n, STORAGE[lay.exps])
        fixed_point.exponents(x, how, e)
        fields.append(e)
    agreed = np.maximum.reduce(fields)
    total = np.zeros(n * lay.words, STORAGE[lay.word])
    for x in inputs:
        w = np.empty(n * lay.words, STORAGE[lay.word])
        fixed_point.encode(x, how, agreed, w)
        total += w  # two's complement: wraps as MPI's integer Sum does
    out = np.empty(n, STORAGE[dtype])
    fixed_point.decode(total, agreed, how, out, Scratch())
    return out


def hard_inputs(ranks, n, dtype, seed):
    """Magnitudes over the type's whole range, subnormals, zeros of both signs, the largest
    finite values (sums that overflow), infinities and NaN."""
    rng = np.random.default_rng(seed)
    info = np.finfo(np.float32 if dtype in ("float32", "bfloat16") else dtype)
    lo, hi = np.log2(float(info.smallest_subnormal)), np.log2(float(info.max))
    out = []
    for _ in range(ranks):
        x = rng.choice([-1.0, 1.0], n) * 2.0 ** rng.uniform(lo, hi, n)
        common = rng.random(n) < 0.5  # half near 1 on every rank: sums that cancel
        x[common] = rng.normal(size=int(common.sum()))
        special = rng.integers(0, n, 12)
        x[special] = [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max),
                      float(info.smallest_subnormal), float(info.tiny), 1e-3, -1e-3, 1.0]
        if dtype == "bfloat16":
            out.append(reference.f32_to_bf16(x.astype(np.float32)))
        else:
            with np.errstate(over="ignore"):
                out.append(x.astype(STORAGE[dtype]))
    return out


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(("pre", "post"), [(1.0, 1.0), (0.3, 0.25), (3.0, 1.0 / 3)])
def test_kernels_match_the_numpy_statement_bit_for_bit(dtype, pre, post):
    for ranks in (1, 2, 5):
        inputs = hard_inputs(ranks, 4099, dtype, seed=ranks)
        got = simulate(inputs, dtype, pre, post)
        want = fixed_point.reference(inputs, dtype, pre, post)
        assert got.tobytes() == want.tobytes(), (dtype, ranks)


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_same_bits_whatever_the_rank_order_and_world_size(dtype):
    inputs = hard_inputs(4, 2003, dtype, seed=11)
    base = simulate(inputs, dtype).tobytes()
    zeros = np.zeros_like(inputs[0])
    assert simulate(inputs[::-1], dtype).tobytes() == base
    assert simulate([inputs[2], zeros, inputs[0], inputs[3], zeros, inputs[1]],
                    dtype).tobytes() == base
    # A cut buffer gives the same elements: nothing depends on neighbours or bucket layout.
    cut = np.concatenate([simulate([x[:777] for x in inputs], dtype),
                          simulate([x[777:] for x in inputs], dtype)])
    assert cut.tobytes() == base


def test_float32_within_25_binades_is_the_exact_sum_rounded_once():
    # Values whose magnitudes span at most 25 binades convert exactly (49 fraction bits hold
    # 24-bit values 25 binades below the largest): the result is the exact sum rounded once,
    # which float64 holds exactly here (five 24-bit values over 25 binades fit in 53 bits).
    rng = np.random.default_rng(3)
    inputs = [(rng.choice([-1, 1], 5000) * 2.0 ** rng.uniform(-12, 12, 5000)).astype(np.float32)
              for _ in range(5)]
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    assert simulate(inputs, "float32").tobytes() == exact.astype(np.float32).tobytes()
    # The rank-order fold rounds after every addition: it misses this on some elements.
    folded = reference.reduce(inputs, "float32", reference.ReduceOp.SUM)
    assert folded.tobytes() != exact.astype(np.float32).tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_error_stays_within_the_documented_bound(dtype):
    # |error| <= p * 2**(e - F - 1) (quantization) + half an ulp of the result (rounding),
    # with 2**e above every rank's magnitude; checked against the exact rational sum.
    rng = np.random.default_rng(5)
    p, n = 7, 300
    inputs = [(rng.normal(size=n) * 10.0 ** rng.integers(-20, 20, n)).astype(dtype)
              for _ in range(p)]
    got = simulate(inputs, dtype)
    frac = fixed_point.LAYOUTS[dtype].frac_bits * fixed_point.LAYOUTS[dtype].words
    for i in range(n):
        exact = sum(Fraction(float(x[i])) for x in inputs)
        top = max(abs(float(x[i])) for x in inputs)
        e = int(np.frexp(top)[1])  # top < 2**e
        ulp = np.spacing(np.abs(got[i]).astype(dtype))
        bound = Fraction(p) * Fraction(2) ** (e - frac - 1) + Fraction(float(ulp)) / 2
        assert abs(Fraction(float(got[i])) - exact) <= bound, (i, got[i], float(exact))


def test_special_values_follow_ieee_addition():
    x = np.float32([np.inf, np.inf, -np.inf, np.nan, 3e38, -0.0, 0.0])
    y = np.float32([1.0, -np.inf, -np.inf, 1.0, 3e38, -0.0, -0.0])
    got = simulate([x, y], "float32")
    assert np.isposinf(got[0]) and np.isnan(got[1]) and np.isneginf(got[2])
    assert np.isnan(got[3]) and np.isposinf(got[4])  # 6e38 overflows float32
    assert got[5:].tobytes() == np.float32([0.0, 0.0]).tobytes()  # +0, never -0


def test_the_world_limit_and_bad_types_name_themselves():
    fixed_point.check_world(fixed_point.MAX_RANKS)
    with pytest.raises(ValueError, match="16384"):
        fixed_point.check_world(fixed_point.MAX_RANKS + 1)
    with pytest.raises(TypeError, match="'int32'"):
        check_floating(Reduction("int32"))
    with pytest.raises(ValueError, match="ADASUM"):
        check_floating(Reduction("float32", op=reference.ReduceOp.ADASUM))
    how = Reduction("float32", op=reference.ReduceOp.MAX)
    with pytest.raises(ValueError, match="MAX"):
        fixed_point.allreduce(np.ones(3, np.float32), np.ones(3, np.float32), how, None)


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_rank_order_fold_is_the_reference_fold(dtype):
    inputs = hard_inputs(3, 3001, dtype, seed=9)
    out = np.empty_like(inputs[0])
    ordered.fold(out, inputs, Reduction(dtype, 0.5, 1 / 3), Scratch())
    want = reference.reduce(inputs, dtype, reference.ReduceOp.SUM, 0.5, 1 / 3)
    assert out.tobytes() == want.tobytes()
