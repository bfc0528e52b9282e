"""Every GPU kernel compiled offline; tests/unit/test_cuda_ptx.py runs this suite.

It runs in its own process with ``MPITRAIN_TEST_GPU_COMPILE=1`` (numba-cuda's real target,
NVVM and ptxas are loaded there, not in the main test process); collected from a plain run it
is ignored.  The compile fixture is shared by the whole suite: each kernel variant is compiled
and assembled once per compute capability.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("MPITRAIN_TEST_GPU_COMPILE") != "1":
    collect_ignore_glob = ["test_*.py"]


class Compiled(NamedTuple):
    ptx: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


@pytest.fixture(scope="session")
def compiled():
    """{(kernel, cc): Compiled} for every kernel of mpitrain.ops.cuda.ptx.kernels() and CCS."""
    from mpitrain.ops.cuda import ptx

    by_text: dict[tuple[str, tuple[int, int]], ptx.Resources] = {}
    out = {}
    for kernel in ptx.kernels():
        for cc in ptx.CCS:
            text = ptx.to_ptx(kernel, cc)
            if (text, cc) not in by_text:
                by_text[text, cc] = ptx.assemble(text, cc, kernel.name)
            out[kernel, cc] = Compiled(text, *by_text[text, cc])
    return out
