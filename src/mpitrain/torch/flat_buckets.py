"""Gradient buckets: flat buffers holding many parameters' gradients, each one a view.

A bucket is one contiguous tensor of a single dtype and device that the engine reduces in one
request, in place.  Parameters are assigned in the order their gradients are expected to
become ready (reverse registration order, as torch's DDP does), a new bucket starting whenever
the current one reaches its byte cap; the first bucket is capped smaller so that the first
reduction starts early in the backward pass.

CPU buckets are allocated with ``Group.shared_empty`` (the memory the data plane reduces from
fastest, e.g. shared memory among a node's ranks); other devices get an ordinary device tensor.
Each parameter owns ``bucket.views[i]``, shaped like the parameter; a bucket may reserve
``extra`` trailing elements after the gradients for whatever else should travel in the same
reduction (DDP puts its "was this parameter used" flags there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

Allocate = Callable[[int], np.ndarray]

FIRST_BUCKET_BYTES = 1024 * 1024  # torch DDP's first-bucket cap


@dataclass(eq=False)
class Bucket:
    """One flat buffer and the parameters whose gradients live in it."""

    index: int
    params: list[torch.Tensor]
    flat: torch.Tensor
    views: list[torch.Tensor]
    numel: int  # gradient elements; flat[numel:] are the reserved extra elements
    positions: dict[int, int] = field(default_factory=dict)  # id(param) -> index in params

    @property
    def extra(self) -> torch.Tensor:
        return self.flat[self.numel:]


def assign(params: Sequence[torch.Tensor], cap_bytes: int,
           first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Split ``params`` (in readiness order) into groups of one dtype and device each.

    A group closes once it holds ``cap_bytes`` (the first closed one: ``min(first_cap_bytes,
    cap_bytes)``); parameters of another dtype or device open their own group.

    Raises:
        ValueError: a negative cap.
    """
    if cap_bytes < 0 or first_cap_bytes < 0:
        raise ValueError(f"bucket caps must be >= 0 bytes, got {cap_bytes} and "
                         f"{first_cap_bytes}")
    open_groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[torch.Tensor]] = []
    for p in params:
        key = (p.dtype, p.device)
        group = open_groups.setdefault(key, [])
        group.append(p)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        cap = min(first_cap_bytes, cap_bytes) if not closed else cap_bytes
        if sizes[key] >= cap:
            closed.append(group)
            del open_groups[key]
            del sizes[key]
    closed.extend(g for g in open_groups.values() if g)
    return closed


def build(groups: Sequence[Sequence[torch.Tensor]], allocate: Allocate,
          extra_per_param: int = 0) -> list[Bucket]:
    """Allocate one zeroed flat buffer per group and carve each parameter's view from it.

    Args:
        groups: from :func:`assign` (each of one dtype and device).
        allocate: returns an uninitialised CPU byte buffer of the given size.
        extra_per_param: trailing elements reserved per parameter after the gradients.
    """
    buckets = []
    for index, group in enumerate(groups):
        dtype, device = group[0].dtype, group[0].device
        numel = sum(p.numel() for p in group)
        total = numel + extra_per_param * len(group)
        if device.type == "cpu":
            itemsize = torch.empty((), dtype=dtype).element_size()
            raw = allocate(total * itemsize)
            flat = torch.from_numpy(raw).view(dtype) if total else torch.empty(0, dtype=dtype)
        else:
            flat = torch.empty(total, dtype=dtype, device=device)
        flat.zero_()
        views, offset = [], 0
        for p in group:
            views.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        buckets.append(Bucket(index, list(group), flat, views, numel,
                              {id(p): i for i, p in enumerate(group)}))
    return buckets


__all__ = ["FIRST_BUCKET_BYTES", "Bucket", "assign", "build"]
