"""mpitrainrun for real on this machine: settings reach every rank, errors stop the launch."""

from __future__ import annotations

import json
import subprocess
import sys

from support import ROOT, job_env

LAUNCH = [sys.executable, "-m", "mpitrain.runner.launch"]


def mpitrainrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCH, *args], env=job_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_settings_reach_every_rank():
    code = ("import json, os, mpitrain as hvd; from mpitrain.core import runtime; hvd.init(); "
            "c = runtime.state().config; "
            "print(json.dumps([hvd.rank(), hvd.local_rank(), c.fusion_threshold, "
            "c.cycle_time_ms, c.allreduce_streams, c.allreduce_algorithm, "
            "c.stall_check_disable, os.environ.get('MY_SETTING')]))")
    result = mpitrainrun("-np", "2", "-H", "localhost:2", "--fusion-threshold-mb", "8",
                         "--cycle-time-ms", "3", "--streams", "2", "--hierarchical-allreduce",
                         "--no-stall-check", "-x", "MY_SETTING=on", "--verbose",
                         sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr
    rows = sorted(json.loads(line) for line in result.stdout.splitlines())
    assert rows == [[r, r, 8 << 20, 3.0, 2, "hierarchical", True, "on"] for r in (0, 1)]
    assert "mpitrainrun: localhost:2" in result.stderr
    assert "-x MPITRAIN_FUSION_THRESHOLD=8388608" in result.stderr


def test_exit_code_of_the_job_is_returned():
    result = mpitrainrun("-np", "1", sys.executable, "-c", "raise SystemExit(3)")
    assert result.returncode != 0


def test_refuses_unknown_host_without_starting_anything():
    result = mpitrainrun("-np", "2", "-H", "localhost:1,no-such-host.invalid:1", sys.executable,
                         "-c", "print('started')")
    assert result.returncode == 2
    assert "host 'no-such-host.invalid' does not resolve" in result.stderr
    assert "started" not in result.stdout


def test_check_build_reports_this_install():
    result = mpitrainrun("--check-build", timeout=180)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Open MPI" in out and "[X] MPI_THREAD_MULTIPLE" in out
    assert "CUDA-aware:    no" in out  # the PyPI Open MPI is built without CUDA
    assert "[X] numba" in out and "[X] torch" in out
    for line in ("torch CUDA device", "numba CUDA", "mpitrain CUDA data plane", "cupy"):
        assert line in out


def test_console_scripts_are_installed():
    bindir = __import__("pathlib").Path(sys.executable).parent
    for name in ("mpitrainrun", "mpitrain-hostfile"):
        result = subprocess.run([str(bindir / name), "--help"], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and f"usage: {name}" in result.stdout
