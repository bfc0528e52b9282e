"""The reduction and cast kernels, run by numba's CUDA simulator, against ops.reference.

Small sizes and few threads keep the simulator (one Python thread per CUDA thread) quick;
two blocks of eight threads over 37 elements still exercise the grid-stride loop and a
ragged tail.
"""

import numpy as np
import pytest
from numba import cuda

from mpitrain.core.dtypes import STORAGE, ReduceOp
from mpitrain.ops import reference
from mpitrain.ops.cuda import kernel_steps, kernels
from mpitrain.ops.reduction import Reduction

N = 37
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
LAUNCH = {"threads": 8, "max_blocks": 2}
OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)
DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64",
          "bool")


def test_runs_in_the_simulator():
    assert kernels.simulated() and cuda.simulator_init is not None


def _inputs(dtype, count, seed):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return [rng.integers(0, 2, N).astype(bool) for _ in range(count)]
    if dtype in ("float16", "float32", "float64"):
        return [(rng.standard_normal(N) * 4).astype(dtype) for _ in range(count)]
    if dtype == "bfloat16":
        return [reference.f32_to_bf16((rng.standard_normal(N) * 4).astype(np.float32))
                for _ in range(count)]
    info = np.iinfo(STORAGE[dtype])
    # Wide enough that sums and products wrap in the narrow types.
    return [rng.integers(max(info.min, -120), min(info.max, 120), N).astype(dtype)
            for _ in range(count)]


def _storage(a, dtype):
    return a.view(np.uint8) if dtype == "bool" else a


def _run(inputs, dtype, op, pre, post, out=None):
    out = np.empty_like(inputs[0]) if out is None else out
    kind = "uint8" if dtype == "bool" else dtype
    scratch = np.empty(N, kernel_steps.accumulator_dtype(kind))
    kernels.reduce_buffers([_storage(a, dtype) for a in inputs], _storage(out, dtype),
                           Reduction(dtype, pre, post, op), scratch, kernels.LaunchConfig(**LAUNCH))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("count", [1, 2, 4])
def test_reduce_matches_the_reference_bit_for_bit(dtype, op, count):
    inputs = _inputs(dtype, count, seed=count * 10 + int(op))
    pre, post = (1.0, 1.0) if dtype == "bool" else (0.5, 3.0)
    got = _run(inputs, dtype, op, pre, post)
    want = reference.reduce(inputs, dtype, op, pre, post)
    np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16"])
def test_integer_scaling_truncates_and_wraps_like_the_reference(dtype):
    inputs = _inputs(dtype, 3, seed=7)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        got = _run(inputs, dtype, op, 2.5, -1.5)
        want = reference.reduce(inputs, dtype, op, 2.5, -1.5)
        np.testing.assert_array_equal(got, want)


def test_float16_accumulates_in_float32():
    # 2048 + 1 + 1 in float16 steps would stay at 2048; in float32 it reaches 2050.
    inputs = [np.full(N, v, dtype=np.float16) for v in (2048.0, 1.0, 1.0)]
    got = _run(inputs, "float16", ReduceOp.SUM, 1.0, 1.0)
    assert (got == np.float16(2050.0)).all()


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan_and_inf():
    values = np.array([1.0, np.inf, -np.inf, np.nan, 1.00390625, 1.01171875, -0.0, 3e38]
                      + [0.0] * (N - 8), dtype=np.float32)
    a = reference.f32_to_bf16(values)
    b = reference.f32_to_bf16(np.zeros(N, dtype=np.float32))
    got = _run([a, b], "bfloat16", ReduceOp.SUM, 1.0, 1.0)
    want = reference.reduce([a, b], "bfloat16", ReduceOp.SUM)
    np.testing.assert_array_equal(got, want)
    assert got[3] == 0x7FC0  # NaN stays a quiet NaN


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX], ids=lambda o: o.name)
def test_min_and_max_propagate_nan_from_any_input_like_the_reference(dtype, op):
    # NaN first, second and third: Python's min/max and the GPU's fminf/fmaxf would drop some.
    values = [np.full(N, v, dtype=np.float32) for v in (1.0, 2.0, 3.0)]
    for k, v in enumerate(values):
        v[k] = np.nan
    inputs = ([reference.f32_to_bf16(v) for v in values] if dtype == "bfloat16"
              else [v.astype(dtype) for v in values])
    for count in (2, 3):
        got = _run(inputs[:count], dtype, op, 1.0, 1.0)
        want = reference.reduce(inputs[:count], dtype, op)
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(want).view(np.uint8))


def test_in_place_output_aliasing_an_input():
    inputs = _inputs("float32", 3, seed=3)
    want = reference.reduce(inputs, "float32", ReduceOp.SUM, 0.25, 2.0)
    _run(inputs, "float32", ReduceOp.SUM, 0.25, 2.0, out=inputs[0])
    np.testing.assert_array_equal(inputs[0], want)


@pytest.mark.parametrize(("src", "dst"), [("float32", "float16"), ("float32", "bfloat16"),
                                          ("float16", "float32"), ("bfloat16", "float32")])
def test_compression_casts_match_the_reference(src, dst):
    values = (np.random.default_rng(5).standard_normal(N) * 100).astype(np.float32)
    values[:3] = [np.nan, np.inf, 65520.0]  # 65520 overflows float16 to inf
    if src == "bfloat16":
        data = reference.f32_to_bf16(values)
    else:
        data = values.astype(src)
    out = np.empty(N, STORAGE[dst])
    kernels.cast(data, out, src, dst, on=kernels.LaunchConfig(**LAUNCH))
    want = reference.narrow(reference.widen(data, src), dst)
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))


def test_cast_rejects_integer_types():
    with pytest.raises(TypeError, match="int32"):
        kernels.cast(np.zeros(4, np.int32), np.zeros(4, np.float32), "int32", "float32")


def test_reduce_plan_reads_each_input_once_and_writes_the_output_last():
    plan = kernel_steps.reduce_plan(4, "float16")
    assert plan == [(0, 1, "float16", "acc32", False), (-1, 2, "acc32", "acc32", False),
                    (-1, 3, "acc32", "float16", True)]
    assert kernel_steps.reduce_plan(2, "int32") == [(0, 1, "int32", "int32", True)]
    with pytest.raises(ValueError, match="at least 2"):
        kernel_steps.reduce_plan(1, "float32")


def test_launch_shape_caps_blocks_and_never_launches_zero():
    assert kernels.launch_shape(0) == (1, 256)
    assert kernels.launch_shape(1000, threads=256) == (4, 256)
    assert kernels.launch_shape(10**9, threads=256, max_blocks=4096) == (4096, 256)
