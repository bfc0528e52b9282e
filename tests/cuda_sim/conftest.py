"""Kernel tests that run numba's CUDA simulator; tests/unit/test_cuda_simulator.py runs them.

numba decides at import whether ``numba.cuda`` is the simulator, so these run in their own
process with ``NUMBA_ENABLE_CUDASIM=1``; collected from a plain run they are ignored.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]
