"""What every rank of a test job under mpirun shares (tests/mpi and tests/gpu conftests).

* ranks other than 0 write their terminal output to a log the driver shows on failure;
* ``@pytest.mark.world_sizes(2, 4)`` skips a test at other sizes;
* after every test the ranks agree on its outcome: a failure on any rank fails the test on
  all ranks, with that rank's message, so ranks never drift apart.
"""

from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def redirect_rank_output() -> None:
    """Send ranks > 0's stdout to $MPITRAIN_TEST_LOGDIR/<rank>.log (the driver shows it)."""
    if WORLD.Get_rank() > 0 and os.environ.get("MPITRAIN_TEST_LOGDIR"):
        log = open(os.path.join(os.environ["MPITRAIN_TEST_LOGDIR"],  # noqa: SIM115
                                f"{WORLD.Get_rank()}.log"), "w")
        os.dup2(log.fileno(), sys.stdout.fileno())


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
