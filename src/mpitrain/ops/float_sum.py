"""The description of one floating-point Sum handed to the deterministic algorithms."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import FLOATING


@dataclass(frozen=True)
class Sum:
    """One floating-point sum as the data plane runs it (Average arrives as a postscale).

    Raises:
        TypeError: ``dtype`` is not a floating-point type.
    """

    dtype: str
    prescale: float = 1.0
    postscale: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in FLOATING:
            raise TypeError(f"a floating-point sum takes {', '.join(sorted(FLOATING))}, "
                            f"not {self.dtype!r}")
