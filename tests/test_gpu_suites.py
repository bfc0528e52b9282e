"""Run tests/gpu under mpirun at 1, 2 and 4 ranks sharing the GPU(s), and with 2 streams.

Without a GPU this is one clean skip (no job is launched, so CI pays nothing);
``MPITRAIN_TEST_REQUIRE_GPU=1`` turns the skip into a failure, for GPU machines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support import ROOT, run_job

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
    with tempfile.TemporaryDirectory() as logdir:
        job_env = dict(env, MPITRAIN_TEST_LOGDIR=logdir, MPITRAIN_TEST_UNDER_GPU="1",
                       MPITRAIN_TEST_REQUIRE_GPU=os.environ.get("MPITRAIN_TEST_REQUIRE_GPU", ""))
        argv = [sys.executable, "-m", "pytest", str(GPU_DIR), "-q", "-p", "no:cacheprovider",
                "--timeout=300", "--timeout-method=thread", "-rs"]
        try:
            result = run_job(np_, argv, env=job_env, timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"GPU suite at {config} hung for {JOB_TIMEOUT:.0f} s:\n"
                        f"{exc.stdout or ''}\n{exc.stderr or ''}"[-8000:])
        logs = "".join(f"\n--- rank {p.stem} ---\n{p.read_text()[-4000:]}"
                       for p in sorted(Path(logdir).glob("*.log")))
    if result.returncode != 0:
        pytest.fail(f"GPU suite at {config} (np={np_}) exited {result.returncode}\n"
                    f"{result.stdout[-12000:]}\n--- stderr ---\n{result.stderr[-6000:]}{logs}",
                    pytrace=False)
    print(result.stdout[-3000:])
