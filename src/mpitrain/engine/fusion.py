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

import numpy as np

from .. import ops
from . import buckets
from .negotiation import Response


class Piece:
    """One tensor of one decided request, as flat storage arrays.

    A plain class with its size worked out once: a round of a thousand small gradients makes
    a thousand pieces, and fusion asks each for its size.
    """

    __slots__ = ("dtype", "index", "input", "nbytes", "output", "reduction", "response")

    def __init__(self, response: Response, index: int, input: np.ndarray,  # noqa: A002
                 output: np.ndarray, dtype: str,
                 reduction: ops.Reduction | None = None) -> None:
        self.response = response
        self.index = index
        self.input = input
        self.output = output
        self.dtype = dtype
        self.reduction = reduction  # an allreduce's, as the data plane runs it
        self.nbytes: int = input.nbytes


def plan(pieces: Iterable[tuple[Hashable, Piece]], threshold: int) -> list[list[Piece]]:
    """Group (key, piece) pairs into buckets of equal key and at most ``threshold`` bytes."""
    keyed = list(pieces)
    if keyed:
        # The common round, a backward pass's gradients of one dtype that fit one bucket:
        # what buckets.plan would return, without its bookkeeping per piece.
        first = keyed[0][0]
        if (all(key == first for key, _ in keyed)
                and sum(piece.nbytes for _, piece in keyed) <= threshold):
            return [[piece for _, piece in keyed]]
    groups = buckets.plan([(key, piece.nbytes) for key, piece in keyed], threshold)
    return [[keyed[i][1] for i in group] for group in groups]
