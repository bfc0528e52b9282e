import numpy as np
import pytest

from mpitrain.core.dtypes import ReduceOp, check_reduce_supported
from mpitrain.ops import reference


def test_bfloat16_round_trip_and_rounding():
    values = np.array([1.0, -2.5, 3.140625, 2.0**100, 0.0, np.inf], dtype=np.float32)
    back = reference.bf16_to_f32(reference.f32_to_bf16(values))
    np.testing.assert_array_equal(back, values)
    # 1 + 2^-9 is not representable: rounds to nearest even (1.0)
    assert reference.bf16_to_f32(reference.f32_to_bf16(np.float32([1 + 2**-9])))[0] == 1.0
    assert np.isnan(reference.bf16_to_f32(reference.f32_to_bf16(np.float32([np.nan])))[0])


def test_sum_with_scaling_floats():
    xs = [np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)]
    out = reference.reduce(xs, "float32", ReduceOp.SUM, prescale=2.0, postscale=0.5)
    np.testing.assert_array_equal(out, [4.0, 6.0])


def test_integer_scaling_truncates_toward_zero():
    xs = [np.array([3, -3], np.int32), np.array([0, 0], np.int32)]
    out = reference.reduce(xs, "int32", ReduceOp.SUM, postscale=0.5)
    np.testing.assert_array_equal(out, [1, -1])
    assert out.dtype == np.int32


def test_integer_sum_wraps_like_c():
    xs = [np.array([120], np.int8), np.array([10], np.int8)]
    assert reference.reduce(xs, "int8", ReduceOp.SUM)[0] == np.int8(-126)


def test_bool_ops():
    xs = [np.array([True, False, False]), np.array([True, True, False])]
    np.testing.assert_array_equal(reference.reduce(xs, "bool", ReduceOp.SUM), [1, 1, 0])
    np.testing.assert_array_equal(reference.reduce(xs, "bool", ReduceOp.MIN), [1, 0, 0])


def test_half_types_accumulate_in_float32():
    # 2048 + 1 is not representable in float16, but 2048 + 1 + 1 = 2050 is.
    xs = [np.array([2048], np.float16), np.array([1], np.float16), np.array([1], np.float16)]
    assert reference.reduce(xs, "float16", ReduceOp.SUM)[0] == 2050


def test_unsupported_combinations():
    with pytest.raises(TypeError, match="Average is not defined on bool"):
        check_reduce_supported("bool", ReduceOp.AVERAGE)
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        check_reduce_supported(dtype, ReduceOp.ADASUM)
    with pytest.raises(TypeError, match="Adasum needs floating-point tensors.*got int32"):
        check_reduce_supported("int32", ReduceOp.ADASUM)
    with pytest.raises(TypeError, match="complex64"):
        check_reduce_supported("complex64", ReduceOp.SUM)
