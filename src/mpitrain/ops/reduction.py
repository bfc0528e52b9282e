"""The description of one reduction as the data plane runs it, handed down every floor.

:class:`Reduction` says what is computed (``postscale * OP_k(prescale * x_k)`` over the
ranks' inputs, in ``dtype``); every algorithm takes one instead of the loose element type,
op and factors.  Any element type and op the data plane supports fits (integers, bool,
Adasum); the deterministic algorithms take only elementwise floating-point ones, checked by
:func:`check_floating`.  :class:`Overrides` says which algorithm and how many channels run it
where the caller (autotune, a benchmark, a test) overrules the configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.dtypes import FLOATING, ReduceOp

# The elementwise reductions (Average arrives as Sum with a postscale; Adasum is not one).
ELEMENTWISE = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


@dataclass(frozen=True)
class Reduction:
    """One reduction: element type name, factors fused before and after, and the op."""

    dtype: str
    prescale: float = 1.0
    postscale: float = 1.0
    op: ReduceOp = ReduceOp.SUM

    def prescale_only(self) -> Reduction:
        """This reduction without its postscale (a first step; a later one applies it)."""
        return dataclasses.replace(self, postscale=1.0)

    def postscale_only(self) -> Reduction:
        """This reduction without its prescale (a later step; an earlier one applied it)."""
        return dataclasses.replace(self, prescale=1.0)

    def unscaled(self) -> Reduction:
        """This reduction without either factor (a middle step: a plain fold)."""
        return dataclasses.replace(self, prescale=1.0, postscale=1.0)


def check_floating(how: Reduction) -> Reduction:
    """``how``, if the deterministic algorithms can run it: elementwise, floating point.

    Raises:
        TypeError: ``dtype`` is not a floating-point type.
        ValueError: ``op`` is not elementwise.
    """
    if how.dtype not in FLOATING:
        raise TypeError(f"a floating-point reduction takes {', '.join(sorted(FLOATING))}, "
                        f"not {how.dtype!r}")
    if how.op not in ELEMENTWISE:
        raise ValueError(f"op {how.op!r} is not elementwise: the deterministic algorithms "
                         f"take {', '.join(o.name for o in ELEMENTWISE)}")
    return how


@dataclass(frozen=True)
class Overrides:
    """Per-call overrides of the configuration; None keeps the configured value."""

    algorithm: str | None = None  # MPITRAIN_ALLREDUCE_ALGORITHM's names
    streams: int | None = None  # parallel channels (MPITRAIN_ALLREDUCE_STREAMS)
