"""Top-level test configuration: tests/mpi only runs under mpirun (see test_mpi_suites.py)."""

import os

collect_ignore = [] if os.environ.get("MPITRAIN_TEST_UNDER_MPI") == "1" else ["mpi"]
