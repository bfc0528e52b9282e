"""Runs inside every rank of a GPU test job (launched by tests/test_gpu_suites.py).

As tests/mpi/conftest.py: one init per job, ``world_sizes`` markers, and a failure on any
rank fails the test on every rank.  All ranks of a job share the machine's GPUs (one GPU:
every rank binds to it), which is what exercises CUDA IPC and streams between processes.
"""

from __future__ import annotations

import os

import pytest
from rank_hooks import (  # noqa: F401 - pytest finds the hooks here
    dump_stacks_on_sigusr1,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
)

dump_stacks_on_sigusr1()


def _require_gpu() -> None:
    from mpitrain.ops import cuda
    if cuda.available():
        return
    if os.environ.get("MPITRAIN_TEST_REQUIRE_GPU") == "1":
        pytest.fail("MPITRAIN_TEST_REQUIRE_GPU=1 but no usable GPU: "
                    + cuda.probe._probe()[1])
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
