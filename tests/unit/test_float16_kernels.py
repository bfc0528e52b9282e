"""The CPU kernels' float16 conversions (LLVM's half conversions) against numpy's casts:
every one of the 65,536 half values widened, and float32 values around every rounding
boundary narrowed; the numpy fallback gives the same bits."""

import numpy as np
import pytest

from mpitrain.ops.kernels import cpu
from mpitrain.ops.reduction import Reduction

ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _float32_cases() -> np.ndarray:
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    # every float32 exponent with the mantissas where rounding to 10 bits turns: exact, just
    # below/at/above the halfway point, odd and even neighbours
    exponents = np.arange(256, dtype=np.uint32) << np.uint32(23)
    mantissas = np.array([0, 1, 0xFFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x5000, 0x7FFFFF,
                          0x400000, 0x3FFFFF, 0x400001], np.uint32)
    grid = (exponents[:, None] | mantissas[None, :]).ravel()
    # the float32 image of every half, and its neighbours
    halves = ALL_HALVES.view(np.float16).astype(np.float32).view(np.uint32)
    near = np.concatenate([halves + np.uint32(d) for d in (1, 0xFFF, 0x1000, 0x1001)])
    bits = np.concatenate([random, grid, grid | np.uint32(0x80000000), halves, near])
    values = bits.view(np.float32)
    # a signalling NaN comes out quiet (as torch's conversion); its bits are checked apart
    signalling = np.isnan(values) & ((bits & np.uint32(0x400000)) == 0)
    return values[~signalling]


@pytest.fixture(params=["llvm", "numpy"])
def path(request, monkeypatch):
    if request.param == "llvm":
        assert cpu._hardware_half(), "LLVM half conversions unavailable on this machine"
    else:
        monkeypatch.setattr(cpu, "_hardware_half", lambda: False)
    return request.param


def test_widen_every_half_exactly(path):
    out = np.empty(ALL_HALVES.size, np.float32)
    cpu.f16_widen(ALL_HALVES.view(np.float16), out)
    expected = ALL_HALVES.view(np.float16).astype(np.float32)
    # signalling NaN halves (exponent all ones, quiet bit 0x200 clear) come out quiet
    signalling = ((ALL_HALVES & 0x7C00) == 0x7C00) & ((ALL_HALVES & 0x3FF) != 0) & (
        (ALL_HALVES & 0x200) == 0)
    np.testing.assert_array_equal(out.view(np.uint32)[~signalling],
                                  expected.view(np.uint32)[~signalling])
    assert np.isnan(out[signalling]).all()
    assert (np.signbit(out[signalling]) == np.signbit(expected[signalling])).all()


def test_narrow_rounds_like_numpy(path):
    values = _float32_cases()
    out = np.empty(values.size, np.float16)
    cpu.f16_narrow(values, out)
    with np.errstate(over="ignore"):
        expected = values.astype(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


def test_signalling_nan_stays_a_nan_when_narrowed():
    values = np.array([0x7F800001, 0xFF812345, 0x7FA00000], np.uint32).view(np.float32)
    out = np.empty(3, np.float16)
    cpu.f16_narrow(values, out)
    assert np.isnan(out).all()
    assert (np.signbit(out) == np.signbit(values)).all()


def test_float16_reduction_matches_the_widened_sum():
    rng = np.random.default_rng(1)
    n = 100_003
    sources = [rng.standard_normal(n).astype(np.float16) for _ in range(3)]
    out = np.empty(n, np.float16)
    acc, tmp = np.empty(n, np.float32), np.empty(n, np.float32)
    cpu.reduce_chunks(out, sources, Reduction("float16", 1.0, 0.25, cpu.ReduceOp.SUM), acc, tmp)
    total = sum(s.astype(np.float32) for s in sources) * np.float32(0.25)
    np.testing.assert_array_equal(out.view(np.uint16), total.astype(np.float16).view(np.uint16))
