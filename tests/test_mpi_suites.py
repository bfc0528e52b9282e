"""Run every file of tests/mpi under mpirun, at each world size and topology it declares.

A file may declare ``MPI_CONFIGS = ("np2", "2x2", ...)`` (names from support.CONFIGS); by
default it runs at 1, 2 and 4 ranks and on the emulated 2x2 topology.  Every rank runs the same
tests in the same order; the conftest in tests/mpi makes a failure on any rank fail that test
on all ranks, and a hang ends the job through pytest-timeout.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support import CONFIGS, DEFAULT_CONFIGS, ROOT, run_job

MPI_DIR = ROOT / "tests" / "mpi"
JOB_TIMEOUT = float(os.environ.get("MPITRAIN_TEST_JOB_TIMEOUT", "600"))
TEST_TIMEOUT = os.environ.get("MPITRAIN_TEST_TIMEOUT", "120")


def _declared_configs(path: Path) -> tuple[str, ...]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MPI_CONFIGS" for t in node.targets):
            configs = tuple(ast.literal_eval(node.value))
            unknown = set(configs) - set(CONFIGS)
            if unknown:
                raise ValueError(f"{path.name}: unknown MPI_CONFIGS {sorted(unknown)}")
            return configs
    return DEFAULT_CONFIGS


CASES = [pytest.param(path, config, id=f"{path.stem}-{config}")
         for path in sorted(MPI_DIR.glob("test_*.py"))
         for config in _declared_configs(path)]


@pytest.mark.parametrize(("path", "config"), CASES)
def test_mpi_suite(path: Path, config: str) -> None:
    np_, env = CONFIGS[config]
    with tempfile.TemporaryDirectory() as logdir:
        job_env = dict(env, MPITRAIN_TEST_UNDER_MPI="1", MPITRAIN_TEST_LOGDIR=logdir)
        argv = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider",
                f"--timeout={TEST_TIMEOUT}", "--timeout-method=thread", "-W",
                "error::pytest.PytestUnraisableExceptionWarning"]
        try:
            result = run_job(np_, argv, env=job_env, timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{path.name} at {config} hung for {JOB_TIMEOUT:.0f} s:\n"
                        f"{exc.stdout or ''}\n{exc.stderr or ''}"[-8000:])
        logs = "".join(f"\n--- rank {p.stem} ---\n{p.read_text()[-4000:]}"
                       for p in sorted(Path(logdir).glob("*.log")))
    if result.returncode != 0:
        pytest.fail(f"{path.name} at {config} (np={np_}) exited {result.returncode}\n"
                    f"--- rank 0 stdout ---\n{result.stdout[-12000:]}\n--- stderr ---\n"
                    f"{result.stderr[-6000:]}{logs}", pytrace=False)
