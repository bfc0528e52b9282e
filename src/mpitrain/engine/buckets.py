"""Gradient buckets: the engine decides which gradients share a flat buffer and allocates it.

An adapter that keeps gradients in flat buffers (DistributedOptimizer, the DDP drop-in) asks
here, through :mod:`mpitrain.collectives.buckets`, instead of reading the fusion threshold and
calling the data plane itself: bucket size and bucket memory have one owner, the engine, as the
fusion of requests does.  Requests whose buffers lie back to back in one bucket then travel as
one collective without packing (the executor checks adjacency), whoever submits them.

Items are planned in the order their gradients are expected to become ready (reverse
registration order, as torch's DDP does), a new bucket starting whenever the current one of the
same key (element type and device) reaches its byte cap; the first bucket to close is capped
smaller so that the first reduction starts early in the backward pass.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

FIRST_BUCKET_BYTES = 1024 * 1024  # torch DDP's first-bucket cap


def plan(items: Sequence[tuple[Hashable, int]], cap_bytes: int,
         first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Split ``items`` ((key, nbytes), in readiness order) into groups of indices of one key.

    A group closes once it holds ``cap_bytes`` (the first closed one:
    ``min(first_cap_bytes, cap_bytes)``); items of another key open their own group.

    Raises:
        ValueError: a negative cap.
    """
    if cap_bytes < 0 or first_cap_bytes < 0:
        raise ValueError(f"bucket caps must be >= 0 bytes, got {cap_bytes} and "
                         f"{first_cap_bytes}")
    open_groups: dict[Hashable, list[int]] = {}
    sizes: dict[Hashable, int] = {}
    closed: list[list[int]] = []
    for index, (key, nbytes) in enumerate(items):
        group = open_groups.setdefault(key, [])
        group.append(index)
        sizes[key] = sizes.get(key, 0) + nbytes
        cap = min(first_cap_bytes, cap_bytes) if not closed else cap_bytes
        if sizes[key] >= cap:
            closed.append(group)
            del open_groups[key]
            del sizes[key]
    closed.extend(g for g in open_groups.values() if g)
    return closed


__all__ = ["FIRST_BUCKET_BYTES", "plan"]
