"""The description of one floating-point reduction handed to the deterministic algorithms."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import FLOATING, ReduceOp

# The elementwise reductions (Average arrives as Sum with a postscale; Adasum is not one).
ELEMENTWISE = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)


@dataclass(frozen=True)
class Reduction:
    """One elementwise reduction of floating-point values, as the data plane runs it.

    Raises:
        TypeError: ``dtype`` is not a floating-point type.
        ValueError: ``op`` is not elementwise.
    """

    dtype: str
    prescale: float = 1.0
    postscale: float = 1.0
    op: ReduceOp = ReduceOp.SUM

    def __post_init__(self) -> None:
        if self.dtype not in FLOATING:
            raise TypeError(f"a floating-point reduction takes {', '.join(sorted(FLOATING))}, "
                            f"not {self.dtype!r}")
        if self.op not in ELEMENTWISE:
            raise ValueError(f"op {self.op!r} is not elementwise: the deterministic algorithms "
                             f"take {', '.join(o.name for o in ELEMENTWISE)}")
