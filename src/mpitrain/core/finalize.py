"""MPI_Finalize with a deadline, for jobs that survived the loss of ranks.

After an elastic recovery in which a rank died inside the survivors' rebuild, Open MPI
5.0.11's ``MPI_Finalize`` sometimes never returns on the last survivor (about 1 job in 20-30 on
the 2-core machine; gdb: ``ompi_mpi_finalize`` sleeping in a loop, after training finished and
every result was written).  mpi4py finalizes at interpreter exit holding the GIL, so nothing in
Python could interrupt it, and the job would hang at its very end.

:func:`finalize_within` is registered (by :func:`mpitrain.session.rebuild`, once ranks were
lost) to run at exit instead: it calls ``MPI_Finalize`` through ctypes, which releases the
GIL, while a timer thread waits; if the call has not returned after the deadline, the process
says so and leaves with the status it was going to have (0, or 1 after an uncaught
exception), without MPI_Finalize -- everything the job computed is already written by then.
mpi4py's own exit handler then finds MPI finalized (or the process gone) and does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from . import _mpi

DEADLINE_S = 20.0

_uncaught = {"seen": False}


def _libmpi_finalize() -> Callable[[], Any] | None:
    """MPI_Finalize of the MPI library this process loaded, callable without the GIL."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi.so" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).MPI_Finalize
        except (OSError, AttributeError):
            continue
    return None


def finalize_within(seconds: float = DEADLINE_S,
                    finalize: Callable[[], Any] | None = None) -> None:
    """Finalize MPI now, or leave the process after ``seconds`` if that does not return.

    Args:
        seconds: how long MPI_Finalize may take.
        finalize: the call to make (default: the library's MPI_Finalize through ctypes); it
            must release the GIL while it runs, or the deadline cannot fire.
    """
    MPI = _mpi.load()
    if MPI.Is_finalized():
        return
    call = finalize or _libmpi_finalize()
    if call is None:  # no library found: mpi4py finalizes at exit, as without this module
        return

    def give_up() -> None:
        status = 1 if _uncaught["seen"] else 0
        sys.stderr.write(f"mpitrain: MPI_Finalize did not return within {seconds:g} s after "
                         f"the job lost ranks (seen with Open MPI 5.0.11 after a death inside "
                         f"a recovery); leaving without it, exit status {status}\n")
        sys.stderr.flush()
        os._exit(status)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        call()
    finally:
        timer.cancel()


def note_uncaught_exceptions() -> None:
    """Remember whether an uncaught exception ends the program (for :func:`finalize_within`'s
    exit status), keeping whatever excepthook is installed."""
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        _uncaught["seen"] = True
        previous(kind, value, tb)

    sys.excepthook = hook


__all__ = ["DEADLINE_S", "finalize_within", "note_uncaught_exceptions"]
