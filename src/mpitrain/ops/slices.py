"""How a buffer is cut into per-rank or per-channel parts: one rule for every algorithm.

Every rank must cut a bucket identically (the parts are who-owns-what), so this is a pure
function of its arguments.
"""

from __future__ import annotations


def balanced(count: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Exactly ``parts`` contiguous (start, stop) ranges covering ``count`` elements, in order.

    Starts are multiples of ``align`` (vector kernels stay aligned); lengths differ by at most
    ``align``, the first ranges being the longer; trailing ranges may be empty when ``count``
    is short.

    Raises:
        ValueError: ``parts`` or ``align`` is not positive, or ``count`` is negative.
    """
    if parts <= 0 or align <= 0:
        raise ValueError(f"parts and align must be positive, got {parts} and {align}")
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    units = (count + align - 1) // align
    base, extra = divmod(units, parts)
    out = []
    start = 0
    for r in range(parts):
        stop = min(count, start + (base + (1 if r < extra else 0)) * align)
        out.append((start, stop))
        start = stop
    return out
