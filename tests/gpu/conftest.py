"""Runs inside every rank of a GPU test job (launched by tests/test_gpu_suites.py).

As tests/mpi/conftest.py: one init per job, ``world_sizes`` markers, and a failure on any
rank fails the test on every rank.  All ranks of a job share the machine's GPUs (one GPU:
every rank binds to it), which is what exercises CUDA IPC and streams between processes.
"""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD

if WORLD.Get_rank() > 0 and os.environ.get("MPITRAIN_TEST_LOGDIR"):
    _log = open(os.path.join(os.environ["MPITRAIN_TEST_LOGDIR"],  # noqa: SIM115
                             f"{WORLD.Get_rank()}.log"), "w")
    os.dup2(_log.fileno(), sys.stdout.fileno())


def _require_gpu() -> None:
    from mpitrain.ops import cuda
    if cuda.available():
        return
    if os.environ.get("MPITRAIN_TEST_REQUIRE_GPU") == "1":
        pytest.fail("MPITRAIN_TEST_REQUIRE_GPU=1 but no usable GPU: "
                    + cuda.runtime._probe()[1])
    pytest.skip("needs a CUDA device (MPITRAIN_TEST_REQUIRE_GPU=1 turns this skip into a "
                "failure)")


@pytest.fixture(scope="session")
def hvd():
    _require_gpu()
    import mpitrain

    mpitrain.init()
    yield mpitrain
    mpitrain.shutdown()


@pytest.fixture(scope="session")
def cupy():
    _require_gpu()
    import cupy as cp
    return cp


def pytest_collection_modifyitems(config, items):
    size = WORLD.Get_size()
    for item in items:
        marker = item.get_closest_marker("world_sizes")
        if marker is not None and size not in marker.args:
            item.add_marker(pytest.mark.skip(reason=f"runs at world sizes {marker.args}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call":
        return
    mine = str(report.longrepr)[-3000:] if report.failed else ""
    everyone = WORLD.allgather(mine)
    failed_elsewhere = [(r, text) for r, text in enumerate(everyone)
                        if text and r != WORLD.Get_rank()]
    if failed_elsewhere and not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(f"failed on rank {r}:\n{text}" for r, text in failed_elsewhere)
