"""A test job that hangs is killed, and the report says where every rank waited.

The MPI and GPU suite drivers (tests/support.py: run_pytest_job) kill a job that outlives its
time limit; before the kill they ask each rank for its Python stacks (SIGUSR1, answered by
tests/rank_hooks.py).  A hang that only happens on another machine (the GPU suite's driver on
the H100) can then be diagnosed from the one report that comes back.
"""

from __future__ import annotations

import time

import pytest

from support import ROOT, run_pytest_job

HANGING_SUITE = '''
import sys
import time
sys.path.insert(0, {tests!r})
from mpi4py import MPI
from rank_hooks import dump_stacks_on_sigusr1

dump_stacks_on_sigusr1()


def rank_one_waits_here_forever():
    time.sleep(600)


def test_hangs():
    if MPI.COMM_WORLD.Get_rank() == 1:
        rank_one_waits_here_forever()
    MPI.COMM_WORLD.Barrier()
'''


def test_a_hung_job_reports_every_ranks_stack(tmp_path):
    (tmp_path / "test_hanging.py").write_text(HANGING_SUITE.format(tests=str(ROOT / "tests")))
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_pytest_job(2, [str(tmp_path / "test_hanging.py"), "--rootdir", str(tmp_path)],
                       env={}, timeout=20, label="hanging suite")
    report = str(failure.value)
    assert "hanging suite hung for 20 s" in report
    assert "rank 1: where it waited" in report, report
    assert "rank_one_waits_here_forever" in report, report
    assert "rank 0: where it waited" in report, report
    assert "test_hangs" in report.split("rank 0: where it waited", 1)[1], report
    assert time.monotonic() - started < 60, "the kill after the stack dump took too long"


PASSING_SUITE = '''
import sys
sys.path.insert(0, {tests!r})
from mpi4py import MPI


def test_every_rank_passes():
    MPI.COMM_WORLD.Barrier()
'''


def test_ranks_after_the_first_write_to_their_logs_not_the_terminal(tmp_path):
    """Rank 0's output is the job's terminal output; rank 1's goes to its log. (Redirected from a
    conftest, rank 1's summary still reached the terminal under pytest 9.2, and under 9.1 rank 1
    failed reading its capture back and the job hung.)"""
    (tmp_path / "test_passing.py").write_text(PASSING_SUITE.format(tests=str(ROOT / "tests")))
    out = run_pytest_job(2, [str(tmp_path / "test_passing.py"), "--rootdir", str(tmp_path)],
                         env={}, timeout=60, label="passing suite")
    assert out.count("1 passed") == 1, out
