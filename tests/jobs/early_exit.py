"""A 2-rank job in which rank 1 leaves early, for tests/jobs/test_early_exit.py.

    mpirun -np 2 python early_exit.py HOW WHEN

HOW is how rank 1 leaves: ``raise`` (an uncaught RuntimeError), ``exit0``/``exit3``
(``sys.exit(n)``), ``os_exit0``/``os_exit3`` (``os._exit(n)``: no cleanup at all), ``sigkill``,
``sigterm``, ``sigsegv`` (the signal sent to itself).  WHEN is where:

* ``before``: before ``init()``, MPI not started (the script never imported mpi4py);
* ``before-mpi``: before ``init()``, the script having started MPI itself (``from mpi4py
  import MPI``);
* ``during``: inside ``init()``, between its collectives (topology.build, patched);
* ``during-engine``: inside ``init()`` once the runtime is up, as its engine starts;
* ``after``: after ``init()``, while rank 0 is in a collective.

Rank 1 prints ``LEFT_AT t`` just before leaving, rank 0 prints ``INIT_AT t`` just before its
``init()`` (wall-clock seconds), so the test can measure how long the job took to end after
the departure.  Light on purpose: numpy and mpitrain's front door, no torch.
"""

from __future__ import annotations

import os
import signal
import sys
import time

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
HOW, WHEN = sys.argv[1], sys.argv[2]

import mpitrain  # noqa: E402,F401 - light: starts no MPI, installs the exit hooks


def leave() -> None:
    print(f"LEFT_AT {time.time():.3f}", flush=True)
    if HOW == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    if HOW.startswith("exit"):
        sys.exit(int(HOW[4:]))
    if HOW.startswith("os_exit"):
        os._exit(int(HOW[7:]))
    if HOW.startswith("sig"):
        os.kill(os.getpid(), getattr(signal, HOW.upper()))
        time.sleep(60)  # the signal ends the process before this does
    raise SystemExit(f"unknown HOW {HOW!r}")


if WHEN == "before-mpi":
    from mpi4py import MPI  # starts MPI, as a user's own script might

    assert MPI.Is_initialized()
if RANK == 1 and WHEN in ("before", "before-mpi"):
    leave()
if RANK == 1 and WHEN == "during":
    from mpitrain.core import topology

    topology.build = lambda *args, **kwargs: leave()
if RANK == 1 and WHEN == "during-engine":
    from mpitrain.engine.engine import Engine

    Engine.start = lambda self: leave()
import numpy as np  # noqa: E402 - the engine's import starts MPI: only from here on

from mpitrain import collectives, session  # noqa: E402

if RANK == 0:
    print(f"INIT_AT {time.time():.3f}", flush=True)
session.init()
if RANK == 1 and WHEN == "after":
    time.sleep(0.5)  # rank 0 is inside an allreduce by now
    leave()
for step in range(600):
    collectives.allreduce(np.ones(4), name=f"step.{step}")
    time.sleep(0.1)
print(f"FINISHED rank {RANK}", flush=True)
