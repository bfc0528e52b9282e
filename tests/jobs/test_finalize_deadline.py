"""MPI_Finalize with a deadline (mpitrain.core.finalize): a finalize that hangs ends the process
with the status it was going to have, and a real one returns and leaves mpi4py's exit quiet.
Each case runs in its own Python process (MPI starts there as a singleton)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from support import job_env

HANGING = textwrap.dedent("""
    import atexit, ctypes, sys
    from mpitrain.core import finalize

    libc = ctypes.CDLL(None)
    finalize.note_uncaught_exceptions()
    # libc's sleep through ctypes releases the GIL, like MPI_Finalize called through ctypes.
    atexit.register(lambda: finalize.finalize_within(1.0, finalize=lambda: libc.sleep(60)))
    if sys.argv[1] == "raise":
        raise RuntimeError("the program failed")
""")


def run(code: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, *args], env=job_env(),
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - started


def test_a_finalize_that_hangs_ends_the_process_with_status_zero():
    proc, seconds = run(HANGING, "ok")
    assert proc.returncode == 0, proc.stderr
    assert ("MPI_Finalize did not return within 1 s after the job lost ranks"
            in proc.stderr), proc.stderr
    assert "exit status 0" in proc.stderr
    assert seconds < 50, seconds  # not the 60 s the hanging call would take


def test_after_an_uncaught_exception_the_status_is_one():
    proc, _ = run(HANGING, "raise")
    assert proc.returncode == 1, proc.stderr
    assert "RuntimeError: the program failed" in proc.stderr
    assert "exit status 1" in proc.stderr


def test_the_real_mpi_finalize_returns_and_mpi4py_exits_quietly():
    proc, _ = run(textwrap.dedent("""
        from mpi4py import MPI
        from mpitrain.core import finalize

        finalize.finalize_within(30.0)
        print("finalized", MPI.Is_finalized(), flush=True)
    """))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "finalized True"
    assert "MPI_Finalize did not return" not in proc.stderr
