"""Run every file of tests/mpi under mpirun, at each world size and topology it declares.

A file may declare ``MPI_CONFIGS = ("np2", "2x2", ...)`` (names from support.CONFIGS); by
default it runs at 1, 2 and 4 ranks and on the emulated 2x2 topology.  Every rank runs the same
tests in the same order; the conftest in tests/mpi makes a failure on any rank fail that test
on all ranks, and a hang ends the job through pytest-timeout.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from support import CONFIGS, DEFAULT_CONFIGS, ROOT, run_pytest_job

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
    run_pytest_job(np_, [str(path), f"--timeout={TEST_TIMEOUT}", "-W",
                         "error::pytest.PytestUnraisableExceptionWarning"],
                   dict(env, MPITRAIN_TEST_UNDER_MPI="1"), JOB_TIMEOUT, f"{path.name} at {config}")
