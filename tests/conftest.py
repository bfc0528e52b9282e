"""Top-level test configuration: tests/mpi only runs under mpirun (see test_mpi_suites.py),
tests/gpu only under the GPU driver (test_gpu_suites.py)."""

import os

collect_ignore = [] if os.environ.get("MPITRAIN_TEST_UNDER_MPI") == "1" else ["mpi"]
if os.environ.get("MPITRAIN_TEST_UNDER_GPU") != "1":
    collect_ignore.append("gpu")
