"""The prepared launches' argument layout against every kernel's real PTX parameter list.

mpitrain.ops.cuda.launch launches numba's kernels through cupy with the arguments laid out as
numba lays out a kernel's parameters; this holds that layout to what numba's compiler really
emits for every variant the data plane launches, for sm_80 and sm_90, and shows the check
fails on a kernel whose parameters differ (the negative control).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from mpitrain.ops.cuda import launch, ptx


class _Array:
    """Just what launch.arguments reads of a device array."""

    def __init__(self, dtype, size, ptr):
        self.dtype, self.size = np.dtype(dtype), size
        self.data = type("Data", (), {"ptr": ptr})()


def _width(value):
    return "f64" if isinstance(value, np.float64) else f"u{value.dtype.itemsize * 8}"


def test_every_variant_takes_the_parameters_the_prepared_launch_passes(compiled):
    checked = 0
    for (kernel, cc), c in compiled.items():
        if kernel.family == "pack":
            continue
        _, params = launch.entry(c.ptx)
        assert params == launch.expected_parameters(kernel), (kernel.name, cc)
        scales = [0.5] * (3 if kernel.family == "combine" else 2)
        args = launch.arguments([_Array(a, 10, 4096) for a in kernel.arrays], 10, scales)
        assert [_width(a) for a in args] == params, (kernel.name, cc)
        checked += 1
    assert checked == 2 * len(ptx.numba_kernels())


def test_the_parameter_check_fails_on_a_kernel_laid_out_otherwise():
    def kernel(a, out, n, scale):  # one scale fewer, a 32-bit count
        i = cuda.grid(1)
        if i < n:
            out[i] = a[i] * scale

    text = cuda.compile_ptx(kernel, "void(float32[::1], float32[::1], int32, float64)",
                            cc=ptx.CCS[-1])[0]
    _, params = launch.entry(text)
    want = launch.expected_parameters(ptx.Kernel("scale", "float32", ("float32", "float32"), "",
                                                 ("float32", "float32")))
    assert params != want
    assert len(params) == 2 * launch.ARRAY_PARAMETERS + 2 and "u32" in params
