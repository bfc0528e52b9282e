"""Buckets: the one rule that cuts a sequence of sized items into buckets, for both of its users.

Gradient buckets (the flat buffers that DistributedOptimizer and the DDP drop-in keep
gradients in, asked for through :mod:`mpitrain.collectives.buckets` and
``Engine.plan_buckets``) and tensor fusion (:mod:`.fusion`, the collectives of one round) are
cut here by the same rule at the same threshold, so a gradient bucket whose requests reach the
executor together is one fused collective, reduced in place without packing (the executor
checks adjacency), whoever submits it.

The rule: items are taken in order (readiness order for gradients: reverse registration, as
torch's DDP does; response order for fusion); an item joins the open bucket of its key
(element type and device; for fusion also the reduce op and scale factors, or the root) when
that bucket stays within its cap, otherwise it opens a new bucket of that key.  So a bucket
never holds more than its cap, and an item larger than the cap travels alone.  The first
bucket (the one holding the first item) may have a smaller cap, so that the first reduction of
a backward pass starts early (torch DDP's 1 MiB).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

FIRST_BUCKET_BYTES = 1024 * 1024  # torch DDP's first-bucket cap


def plan(items: Iterable[tuple[Hashable, int]], cap_bytes: int,
         first_cap_bytes: int | None = None) -> list[list[int]]:
    """Split ``items`` ((key, nbytes), in order) into buckets of indices of one key each.

    A bucket holds at most ``cap_bytes`` (the first: ``min(first_cap_bytes, cap_bytes)``)
    unless it is a single item larger than that.  Buckets are listed in the order of their
    first item; ``cap_bytes=0`` puts every item in a bucket of its own.

    Raises:
        ValueError: a negative cap.
    """
    if cap_bytes < 0 or (first_cap_bytes is not None and first_cap_bytes < 0):
        raise ValueError(f"bucket caps must be >= 0 bytes, got {cap_bytes} and "
                         f"{first_cap_bytes}")
    first_cap = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    open_at: dict[Hashable, int] = {}  # key -> position of its open bucket in ``buckets``
    open_bytes: dict[Hashable, int] = {}
    buckets: list[list[int]] = []
    for index, (key, nbytes) in enumerate(items):
        at = open_at.get(key)
        if at is not None and open_bytes[key] + nbytes <= (first_cap if at == 0 else cap_bytes):
            buckets[at].append(index)
            open_bytes[key] += nbytes
            continue
        open_at[key] = len(buckets)
        open_bytes[key] = nbytes
        buckets.append([index])
    return buckets


__all__ = ["FIRST_BUCKET_BYTES", "plan"]
