"""Tensor fusion: pack the tensors of one round that can travel together into buckets.

Allreduce pieces share a bucket when they agree on element type, reduce op and scale factors;
broadcast pieces when they share a root.  The cutting is :func:`.buckets.plan`'s, the rule
gradient buckets are cut by too: buckets keep the order in which their first piece appeared
and hold at most ``threshold`` bytes (a piece larger than that travels alone).  The plan
depends only on the responses, which are identical everywhere, so every rank builds the same
buckets.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from .. import ops
from . import buckets
from .negotiation import Response


@dataclass(eq=False)
class Piece:
    """One tensor of one decided request, as flat storage arrays."""

    response: Response
    index: int
    input: np.ndarray
    output: np.ndarray
    dtype: str
    reduction: ops.Reduction | None = None  # an allreduce's, as the data plane runs it

    @property
    def nbytes(self) -> int:
        return int(self.input.nbytes)


def plan(pieces: Iterable[tuple[Hashable, Piece]], threshold: int) -> list[list[Piece]]:
    """Group (key, piece) pairs into buckets of equal key and at most ``threshold`` bytes."""
    keyed = list(pieces)
    groups = buckets.plan([(key, piece.nbytes) for key, piece in keyed], threshold)
    return [[keyed[i][1] for i in group] for group in groups]
