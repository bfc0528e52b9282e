"""The property-based bad-input suite (tests/mpi/properties_bad_input.py) at 2 and 3 ranks.

Each run is one MPI job of pytest with Hypothesis inside every rank; the job's rank 0 says how
many cases ran and how they ended, which this test prints (also when it passes).
``MPITRAIN_PROPERTY_EXAMPLES`` sets the number of generated cases per world size (default
120; 0 runs only the kept cases that once found bugs).
"""

from __future__ import annotations

import os
import re

import pytest

from support import ROOT, run_pytest_job

SUITE = ROOT / "tests" / "mpi" / "properties_bad_input.py"
EXAMPLES = os.environ.get("MPITRAIN_PROPERTY_EXAMPLES", "120")


@pytest.mark.parametrize("np_", [2, 3])
def test_bad_input_properties(np_, capsys):
    out = run_pytest_job(np_, [str(SUITE), "-s", "--timeout=900"],
                         {"MPITRAIN_TEST_UNDER_MPI": "1",
                          "MPITRAIN_PROPERTY_EXAMPLES": EXAMPLES},
                         timeout=1000, label=f"properties_bad_input.py at {np_} ranks")
    counts = re.findall(r"PROPERTY CASES at (\d+) ranks: (\d+) cases, (\d+) gave the "
                        r"reference result on every rank, (\d+) raised a clear error where "
                        r"they had to", out)
    assert len(counts) == 1, out[-3000:]
    size, total, succeeded, raised = map(int, counts[0])
    assert size == np_ and total >= 3 and succeeded + raised == total, counts
    if int(EXAMPLES) > 0:  # random cases find both outcomes; the kept ones only raise
        assert succeeded > 0 and raised > 0, counts
    with capsys.disabled():
        print(f"\nbad-input properties at {np_} ranks: {total} cases ({succeeded} gave the "
              f"reference result on every rank, {raised} raised a clear error where they had "
              "to)")
