"""The numba reduction kernels against the numpy reference, without MPI."""

import numpy as np
import pytest

from mpitrain.core.dtypes import STORAGE, ReduceOp
from mpitrain.ops import reference
from mpitrain.ops.kernels import cpu
from mpitrain.ops.reduction import Reduction

OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]


def sources(dtype: str, n: int, count: int, op: ReduceOp) -> list[np.ndarray]:
    gen = np.random.default_rng(n * 17 + count)
    out = []
    for _ in range(count):
        if dtype == "bool":
            out.append(gen.random(n) > 0.5)
        elif dtype in ("uint8", "int8", "int16", "int32", "int64"):
            hi = 4 if op == ReduceOp.PRODUCT else 127
            out.append(gen.integers(0 if dtype == "uint8" else -hi, hi, n).astype(STORAGE[dtype]))
        else:
            data = gen.normal(size=n).astype(np.float32)
            out.append(reference.f32_to_bf16(data) if dtype == "bfloat16"
                       else data.astype(STORAGE[dtype]))
    return out


def run(dtype, srcs, op, pre, post, out=None):
    n = srcs[0].size
    out = np.empty(n, dtype=STORAGE[dtype]) if out is None else out
    acc = np.empty(n, dtype=cpu.acc_dtype(dtype))
    tmp = np.empty(n, dtype=np.float32)
    cpu.reduce_chunks(out, srcs, Reduction(dtype, pre, post, op), acc, tmp)
    return out


@pytest.mark.parametrize("dtype", list(STORAGE))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("count", [1, 2, 4])
def test_matches_reference_bitwise(dtype, op, count):
    scales = [(1.0, 1.0)] if dtype == "bool" else [(1.0, 1.0), (0.5, 3.0), (1.5, 0.25)]
    for pre, post in scales:
        for n in (0, 1, 13, 4099):
            srcs = sources(dtype, n, count, op)
            got = run(dtype, srcs, op, pre, post)
            want = reference.reduce(srcs, dtype, op, pre, post)
            assert got.view(np.uint8).tobytes() == np.asarray(want).view(np.uint8).tobytes(), \
                (dtype, op, count, pre, post, n)


def test_integer_sums_wrap_like_c():
    a = np.array([120, -120, 100], dtype=np.int8)
    got = run("int8", [a, a], ReduceOp.SUM, 1.0, 1.0)
    np.testing.assert_array_equal(got, np.array([-16, 16, -56], dtype=np.int8))


def test_nan_propagates_through_min_and_max():
    a = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    b = np.array([np.nan, 2.0, 1.0], dtype=np.float32)
    for op, third in ((ReduceOp.MIN, 1.0), (ReduceOp.MAX, 3.0)):
        got = run("float32", [a, b], op, 1.0, 1.0)
        assert np.isnan(got[0]) and np.isnan(got[1]) and got[2] == third


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan():
    values = np.array([1.0, 1.00390625, 1.01171875, np.nan, -3.3e38], dtype=np.float32)
    bits = np.empty(values.size, dtype=np.uint16)
    cpu.bf16_narrow(values, bits)
    np.testing.assert_array_equal(bits, reference.f32_to_bf16(values))
    back = np.empty(values.size, dtype=np.float32)
    cpu.bf16_widen(bits, back)
    np.testing.assert_array_equal(back.view(np.uint32), reference.bf16_to_f32(bits).view(np.uint32))


def test_output_may_alias_a_source():
    srcs = sources("float32", 1000, 3, ReduceOp.SUM)
    want = reference.reduce(srcs, "float32", ReduceOp.SUM, 1.0, 0.5)
    run("float32", srcs, ReduceOp.SUM, 1.0, 0.5, out=srcs[1])
    np.testing.assert_array_equal(srcs[1], want)


def test_half_precision_needs_a_float32_scratch():
    a = np.ones(4, dtype=np.float16)
    with pytest.raises(ValueError, match="float16"):
        cpu.reduce_chunks(a, [a, a], Reduction("float16", 1.0, 1.0, ReduceOp.SUM),
                          np.empty(4, np.float32))
