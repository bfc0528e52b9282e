"""Run tests/cuda_sim (the CUDA kernels' code) under numba's CUDA simulator, in a subprocess."""

import os
import subprocess
import sys

from support import ROOT


def test_cuda_kernels_under_the_numba_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(ROOT / "tests" / "cuda_sim"), "-q",
         "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    # Exit 5 (nothing collected) must fail too: the suite would have silently vanished.
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout
