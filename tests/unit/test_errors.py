"""Ranks named in error messages: one line however large the job."""

import pytest

from mpitrain.core.errors import ranks_text


@pytest.mark.parametrize("ranks, text", [
    ([3], "rank 3"),
    ([1, 2, 3], "ranks 1-3"),
    ([0, 2], "ranks 0, 2"),
    ([1, 2, 3, 5], "ranks 1-3, 5"),
    ([0, 1, 4, 5, 6, 9], "ranks 0-1, 4-6, 9"),
    (list(range(1024)), "ranks 0-1023"),
])
def test_runs_of_ranks_collapse(ranks, text):
    assert ranks_text(ranks) == text
