"""The GPU kernels compiled to PTX and machine code for sm_80 and sm_90 on this CPU-only machine.

The compile suite (tests/gpu_compile) runs in its own process and needs NVIDIA's compilers
from PyPI (``pip install 'mpitrain[gpu-compile]'``, which scripts/test.sh installs).  Without
them it is one clean skip saying what is missing, unless ``MPITRAIN_TEST_REQUIRE_GPU_COMPILE=1``
(set by .ci/run) makes that a failure, so CI can never lose the check silently.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from mpitrain.core.dtypes import FLOATING, STORAGE, ReduceOp
from mpitrain.ops.cuda import kernel_steps, kernels, ptx
from mpitrain.ops.reduction import Reduction
from support import ROOT

SUITE_TIMEOUT = 540


class _Recorder:
    """Stands in for a kernel factory: records what reduce_buffers/cast would launch."""

    def __init__(self, family, launched):
        self.family, self.launched = family, launched

    def __call__(self, *args):
        kinds = tuple(a for a in args if isinstance(a, str))
        op = next((a.name for a in args if isinstance(a, ReduceOp)), "")

        def launch(*call_args):
            arrays = tuple(a.dtype.name for a in call_args if isinstance(a, np.ndarray))
            self.launched.add((self.family, kinds, op, arrays))

        return type("Launch", (), {"__getitem__": lambda _self, _config: launch})()


def test_the_kernel_list_is_exactly_what_reduce_and_cast_launch(monkeypatch):
    launched: set[tuple] = set()
    monkeypatch.setattr(kernels, "combine_kernel", _Recorder("combine", launched))
    monkeypatch.setattr(kernels, "scale_kernel", _Recorder("scale", launched))
    n = 4
    for dtype, storage in STORAGE.items():
        acc = kernel_steps.accumulator_dtype("uint8" if dtype == "bool" else dtype)
        for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
            for count in range(1, 6):
                inputs = [np.zeros(n, storage) for _ in range(count)]
                kernels.reduce_buffers(inputs, np.zeros(n, storage),
                                       Reduction(dtype, 0.5, 2.0, op), np.zeros(n, acc))
    for src in FLOATING:
        for dst in FLOATING:
            kernels.cast(np.zeros(n, STORAGE[src]), np.zeros(n, STORAGE[dst]), src, dst, 0.5)
    listed = {(k.family, k.kinds, k.op, k.arrays) for k in ptx.numba_kernels()}
    assert launched == listed


def test_every_gpu_kernel_compiles_for_sm80_and_sm90_and_passes_the_ptx_checks():
    problem = ptx.missing_toolchain()
    if problem:
        if os.environ.get("MPITRAIN_TEST_REQUIRE_GPU_COMPILE") == "1":
            pytest.fail(f"MPITRAIN_TEST_REQUIRE_GPU_COMPILE=1 but {problem}")
        pytest.skip(f"GPU compilers not installed ({problem})")
    env = dict(os.environ, MPITRAIN_TEST_GPU_COMPILE="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "tests" / "gpu_compile"), "-q",
         "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=SUITE_TIMEOUT)
    # Exit 5 (nothing collected) must fail too: the suite would have silently vanished.
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]
