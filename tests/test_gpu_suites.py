"""Run tests/gpu under mpirun at 1, 2 and 4 ranks sharing the GPU(s), and with 2 streams.

Without a GPU this is one clean skip (no job is launched, so CI pays nothing);
``MPITRAIN_TEST_REQUIRE_GPU=1`` turns the skip into a failure, for GPU machines.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support import ROOT, run_pytest_job

GPU_DIR = ROOT / "tests" / "gpu"
JOB_TIMEOUT = float(os.environ.get("MPITRAIN_TEST_JOB_TIMEOUT", "900"))
CONFIGS = {
    "np1": (1, {}),
    "np2": (2, {}),
    "np4": (4, {}),
    "np2-streams2": (2, {"MPITRAIN_ALLREDUCE_STREAMS": "2"}),
    "np4-staging": (4, {"MPITRAIN_CUDA_AWARE_MPI": "0", "MPITRAIN_ALLREDUCE_ALGORITHM": "mpi"}),
    "2x2": (4, {"MPITRAIN_LOCAL_SIZE": "2"}),
}


def _gpu_usable() -> bool:
    code = "from mpitrain.ops import cuda; raise SystemExit(0 if cuda.available() else 1)"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 0


@pytest.fixture(scope="module")
def gpu():
    if _gpu_usable():
        return
    if os.environ.get("MPITRAIN_TEST_REQUIRE_GPU") == "1":
        pytest.fail("MPITRAIN_TEST_REQUIRE_GPU=1 but cupy sees no usable GPU")
    pytest.skip("needs a CUDA device and cupy (MPITRAIN_TEST_REQUIRE_GPU=1 makes this fail)")


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS))
def test_gpu_suite(gpu, config: str) -> None:
    np_, env = CONFIGS[config]
    job_env = dict(env, MPITRAIN_TEST_UNDER_GPU="1",
                   MPITRAIN_TEST_REQUIRE_GPU=os.environ.get("MPITRAIN_TEST_REQUIRE_GPU", ""))
    out = run_pytest_job(np_, [str(GPU_DIR), "--timeout=300", "-rs"], job_env, JOB_TIMEOUT,
                         f"GPU suite at {config}")
    print(out[-3000:])
