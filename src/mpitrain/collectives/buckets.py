"""Gradient buckets for torch adapters: flat buffers holding many parameters' gradients, each
one a view, sized and allocated by the engine (:mod:`mpitrain.engine.buckets`).

A bucket is one contiguous tensor of a single dtype and device that the engine reduces in one
collective, in place, whether it is submitted as one request (the DDP drop-in) or as one
request per parameter view (DistributedOptimizer, whose per-parameter names the timeline and
negotiation keep).  CPU buckets live in the memory the engine hands out for that (the data
plane reads it without a copy into a fusion buffer); other devices get an ordinary device
tensor.  Each parameter owns ``bucket.views[i]``, shaped like the parameter; a bucket may
reserve ``extra`` trailing elements after the gradients for whatever else should travel in the
same reduction (DDP puts its "was this parameter used" flags there).

A bucket may hold its views in another element type than the parameters (``dtype_of``):
DistributedOptimizer with ``Compression.fp16``/``bf16`` keeps float16/bfloat16 wire buckets
that backward's float32 gradients are cast into, so the 16-bit bytes are reduced where they lie.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import session
from ..core.process_sets import ProcessSet, set_id_of
from ..engine.buckets import FIRST_BUCKET_BYTES

Allocate = Callable[[int], np.ndarray]
DtypeOf = Callable[[torch.Tensor], Any]  # a parameter -> the element type of its view


def _own_dtype(p: torch.Tensor) -> Any:
    return p.dtype


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


def gradient_buckets(params: Sequence[torch.Tensor], process_set: ProcessSet,
                     cap_bytes: int | None = None,
                     first_cap_bytes: int | None = FIRST_BUCKET_BYTES,
                     extra_per_param: int = 0, dtype_of: DtypeOf = _own_dtype) -> list[Bucket]:
    """Flat, zeroed buckets for ``params`` (in the order their gradients become ready).

    Args:
        params: the parameters, in readiness order.
        process_set: the set whose collectives will reduce the buckets (this rank a member).
        cap_bytes: bytes per bucket; None means the engine's fusion threshold.
        first_cap_bytes: the smaller cap of the first bucket to close (None: no smaller cap).
        extra_per_param: trailing elements reserved per parameter after the gradients.
        dtype_of: the element type of a parameter's view (default: the parameter's own).

    Raises:
        ValueError: a negative cap, or this rank is not a member of ``process_set``.
    """
    engine = session.engine()
    set_id = set_id_of(process_set)
    return build(group_gradients(params, cap_bytes, first_cap_bytes, dtype_of),
                 lambda nbytes: engine.bucket_memory(set_id, nbytes), extra_per_param,
                 dtype_of)


def group_gradients(params: Sequence[torch.Tensor], cap_bytes: int | None = None,
                    first_cap_bytes: int | None = FIRST_BUCKET_BYTES,
                    dtype_of: DtypeOf = _own_dtype) -> list[list[torch.Tensor]]:
    """The groups of ``params`` that :func:`gradient_buckets` makes (one element type and
    device each, in readiness order, closed at the caps), without allocating buffers: for a
    stateful compressor, which works on the gradients where they are."""
    items = []
    for p in params:
        dtype = dtype_of(p)
        items.append(((dtype, p.device), p.numel() * _itemsize(dtype)))
    groups = session.engine().plan_buckets(items, cap_bytes, first_cap_bytes)
    return [[params[i] for i in g] for g in groups]


def _itemsize(dtype: Any) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def build(groups: Sequence[Sequence[torch.Tensor]], allocate: Allocate,
          extra_per_param: int = 0, dtype_of: DtypeOf = _own_dtype) -> list[Bucket]:
    """Allocate one zeroed flat buffer per group and carve each parameter's view from it.

    Args:
        groups: parameters whose views share one dtype and device each.
        allocate: returns a CPU byte buffer of the given size.
        extra_per_param: trailing elements reserved per parameter after the gradients.
        dtype_of: the element type of a parameter's view (default: the parameter's own).
    """
    buckets = []
    for index, group in enumerate(groups):
        dtype, device = dtype_of(group[0]), group[0].device
        numel = sum(p.numel() for p in group)
        total = numel + extra_per_param * len(group)
        if device.type == "cpu":
            raw = allocate(total * _itemsize(dtype))
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


__all__ = ["Bucket", "build", "gradient_buckets"]
