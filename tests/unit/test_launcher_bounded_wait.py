"""mpitrainrun ends an MPI launcher that said it was ending the job and then did not exit.

Open MPI 5.0.11's prterun was seen (CI, a rank leaving with ``os._exit(3)`` while the other was
in ``MPI_Init``) to print "... thus causing the job to be terminated" and then stay forever.
A fake launcher plays that here; the same wait must not cut short a launcher that is merely
slow, nor one that never said the job was ending.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mpitrain.runner import launch
from mpitrain.runner.launcher_report import LauncherWatch, wait_bounded

REPORT = ("prterun detected that one or more processes exited with non-zero status,\n"
          "thus causing the job to be terminated. The first process to do so was:\n")


def fake_launcher(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_a_launcher_that_reports_the_end_and_hangs_is_ended_with_status_1(capfd):
    proc = fake_launcher(f"import sys, time; sys.stderr.write({REPORT!r}); sys.stderr.flush(); "
                         "time.sleep(600)")
    start = time.monotonic()
    code = wait_bounded(proc, LauncherWatch(proc), "mpitrainrun", grace_s=1.0)
    assert code == 1
    assert time.monotonic() - start < 20
    assert proc.poll() is not None
    err = capfd.readouterr().err
    assert "thus causing the job to be terminated" in err  # the launcher's words copied through
    assert "mpitrainrun: the MPI launcher said it was ending the job 1 s ago" in err


def test_a_slow_launcher_that_never_said_so_keeps_running_until_it_exits():
    proc = fake_launcher("import time; time.sleep(2.5); raise SystemExit(7)")
    assert wait_bounded(proc, LauncherWatch(proc), "mpitrainrun", grace_s=0.5) == 7


def test_a_launcher_that_reports_the_end_and_exits_keeps_its_status():
    proc = fake_launcher(f"import sys; sys.stderr.write({REPORT!r}); raise SystemExit(3)")
    assert wait_bounded(proc, LauncherWatch(proc), "mpitrainrun", grace_s=30.0) == 3


def test_mpitrainrun_runs_its_launcher_through_the_bounded_wait(monkeypatch):
    code = f"import sys, time; sys.stderr.write({REPORT!r}); sys.stderr.flush(); time.sleep(600)"
    monkeypatch.setattr(launch, "wait_bounded",
                        lambda proc, watch, who: wait_bounded(proc, watch, who, grace_s=1.0))
    start = time.monotonic()
    assert launch._run([sys.executable, "-c", code]) == 1
    assert time.monotonic() - start < 20


@pytest.mark.parametrize("words", ["MPI_ABORT was invoked on rank 1 in communicator",
                                   "PRTE has lost communication with a remote daemon."])
def test_every_way_open_mpi_says_it_ends_the_job_starts_the_clock(words):
    proc = fake_launcher(f"import sys, time; sys.stdout.write({words!r}); sys.stdout.flush(); "
                         "time.sleep(600)")
    assert wait_bounded(proc, LauncherWatch(proc), "mpitrainrun", grace_s=0.5) == 1
