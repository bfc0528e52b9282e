"""Start pytest in one rank of a test job, after sending a rank > 0's terminal output to
$MPITRAIN_TEST_LOGDIR/<rank>.log (the driver, tests/support.py, shows those logs on failure).

Why a separate start: a conftest runs after pytest has put its own capture file on
descriptor 1, so redirecting "stdout" from there replaced pytest's capture file, not the
terminal. pytest 9.2 then printed rank 1's summary on the terminal anyway; pytest 9.1 (the GPU
machine's) failed reading its capture back, rank 1 ran no test and never joined rank 0's
``init()``: the GPU suite's driver hung on every GPU machine (2026-11-26/27, found 2026-11-27).
The rank is read from the launcher's environment, since MPI is not initialised yet.
"""

import os
import sys

import pytest

RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


def launcher_rank() -> int:
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


if __name__ == "__main__":
    logdir = os.environ.get("MPITRAIN_TEST_LOGDIR")
    rank = launcher_rank()
    if logdir and rank > 0:
        log = os.open(os.path.join(logdir, f"{rank}.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, sys.stdout.fileno())
        os.close(log)
    sys.exit(pytest.main(sys.argv[1:]))
