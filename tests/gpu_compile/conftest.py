"""Every GPU kernel compiled offline; tests/unit/test_cuda_ptx.py runs this suite.

It runs in its own process with ``MPITRAIN_TEST_GPU_COMPILE=1`` (numba-cuda's real target,
NVVM and ptxas are loaded there, not in the main test process); collected from a plain run it
is ignored.  The compile fixture is shared by the whole suite: each kernel variant is compiled
and assembled once per compute capability.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
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


def compile_for(cc: tuple[int, int]) -> dict:
    """{kernel: Compiled} for every kernel at one compute capability (one worker's share)."""
    from mpitrain.ops.cuda import ptx

    by_text: dict[str, ptx.Resources] = {}
    out = {}
    for kernel in ptx.kernels():
        text = ptx.to_ptx(kernel, cc)
        if text not in by_text:
            by_text[text] = ptx.assemble(text, cc, kernel.name)
        out[kernel] = Compiled(text, *by_text[text])
    return out


@pytest.fixture(scope="session")
def compiled():
    """{(kernel, cc): Compiled} for every kernel of mpitrain.ops.cuda.ptx.kernels() and CCS.

    One process per compute capability: compiling and assembling every kernel twice is most
    of this suite's time (about 40 s on one core), and CI has two.
    """
    from mpitrain.ops.cuda import ptx

    spawn = multiprocessing.get_context("spawn")  # a fresh numba-cuda in each worker
    with ProcessPoolExecutor(len(ptx.CCS), mp_context=spawn) as pool:
        per_cc = dict(zip(ptx.CCS, pool.map(compile_for, ptx.CCS)))
    return {(kernel, cc): c for cc, kernels in per_cc.items() for kernel, c in kernels.items()}
