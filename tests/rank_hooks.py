"""What every rank of a test job under mpirun shares (tests/mpi and tests/gpu conftests).

* ranks other than 0 write their terminal output to a log the driver shows on failure (set up
  before pytest starts, by tests/rank_pytest.py);
* SIGUSR1 makes a rank write every thread's Python stack to $MPITRAIN_TEST_LOGDIR/<rank>.stacks:
  the driver sends it to a hung job before killing it (tests/support.py), so a hang report says
  where each rank waited (a file, because pytest holds stderr until a test ends);
* ``@pytest.mark.world_sizes(2, 4)`` skips a test at other sizes;
* after every test the ranks agree on its outcome: a failure on any rank fails the test on
  all ranks, with that rank's message, so ranks never drift apart.
"""

from __future__ import annotations

import faulthandler
import os
import signal

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
_KEEP_OPEN: list = []


def dump_stacks_on_sigusr1() -> None:
    """Let SIGUSR1 write every thread's stack to $MPITRAIN_TEST_LOGDIR/<rank>.stacks (the
    driver's hang report). Ranks > 0's terminal output goes to their logs from the start
    (tests/rank_pytest.py): a conftest is too late to redirect it."""
    logdir = os.environ.get("MPITRAIN_TEST_LOGDIR")
    if logdir:
        stacks = open(os.path.join(logdir, f"{WORLD.Get_rank()}.stacks"), "w")  # noqa: SIM115
        _KEEP_OPEN.append(stacks)  # faulthandler writes to the descriptor: it must stay open
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)


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
