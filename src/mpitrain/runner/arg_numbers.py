"""The numeric argument types of ``mpitrainrun``'s options: a number read, then its bound checked.

Every number option, the launch's and the rendezvous's, refuses a bad value the same way:
``'x' is not an integer`` where the text is no number, ``'0' must be >= 1`` where it is one
out of bounds, both as :class:`argparse.ArgumentTypeError` so that argparse prints them as the
option's error.  One factory keeps the two messages, and the NaN a float may read as, alike for
all of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def bounded(read: Callable[[str], N], noun: str, low: N, *, strict: bool = False,
            unit: str = "") -> Callable[[str], N]:
    """An argparse ``type`` reading a number with ``read`` that is at least ``low`` (above it
    when ``strict``); ``noun`` names what the text should have been (``"an integer"``) and
    ``unit`` follows the bound in the message (``"> 0 seconds"``)."""
    bound = f"{'>' if strict else '>='} {low:g}{unit}"  # 0, not 0.0, for a float

    def parse(text: str) -> N:
        try:
            value = read(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        # Written as "not in bounds" so that a float's NaN, which compares false, is refused.
        if not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(f"{text!r} must be {bound}")
        return value

    return parse


pos_int = bounded(int, "an integer", 1)
nonneg_int = bounded(int, "an integer", 0)
nonneg_float = bounded(float, "a number", 0.0)
