"""Runs inside every rank of an MPI test job (launched by tests/test_mpi_suites.py).

mpitrain is initialised once per job (``hvd`` fixture) and shut down at the end; the
``world_sizes`` marker, the ranks' shared verdict on every test and the per-rank logs come from
tests/rank_hooks.py.
"""

from __future__ import annotations

import pytest
from rank_hooks import (  # noqa: F401 - pytest finds the hooks here
    dump_stacks_on_sigusr1,
    pytest_collection_modifyitems,
    pytest_runtest_makereport,
)

dump_stacks_on_sigusr1()


@pytest.fixture(scope="session")
def hvd():
    import mpitrain

    mpitrain.init()
    yield mpitrain
    mpitrain.shutdown()
