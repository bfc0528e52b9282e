"""MXNet's gradient compression for KVStore pushes: fp16, bf16, and 2-bit with error feedback.

``2bit`` is MXNet's scheme (``kv.set_gradient_compression({"type": "2bit", "threshold":
t})``): each rank adds its gradient to a residual kept per key; elements whose residual
reaches ``+t`` are sent as ``+t`` (and ``t`` is taken off the residual), those at or below
``-t`` as ``-t``, all others as 0 and stay in the residual for later pushes (error feedback).
Each element travels as 2 bits (four per byte).  Quantised values cannot be summed in their
packed form, so the packed codes are allgathered (``p * n / 4`` bytes received instead of an
allreduce's ``2 * 4n``) and every rank decodes and sums them, identically.

``fp16``/``bf16`` cast floating pushes for the wire and back after the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import collectives
from ..collectives import Handle
from ..compression import Compression

Finish = Callable[[Any], torch.Tensor]

_TYPES = ("none", "fp16", "bf16", "2bit")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..3 -> four per byte (padded with zeros)."""
    pad = (-codes.numel()) % 4
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    quads = codes.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`_pack` for rows of packed bytes: (rows, bytes) -> (rows, n)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    codes = (packed.unsqueeze(-1) >> shifts) & 3
    return codes.reshape(packed.shape[0], -1)[:, :n]


class GradientCompression:
    """What a KVStore does to a merged gradient before summing it across ranks.

    Args:
        params: ``None`` or ``{"type": "none"|"fp16"|"bf16"|"2bit", "threshold": t}``
            (``threshold`` only for ``2bit``, default 0.5 as in MXNet).

    Raises:
        ValueError: an unknown type, a threshold that is not positive, or unknown keys.
        TypeError: ``params`` is not a dict.
    """

    def __init__(self, params: dict[str, Any] | None = None) -> None:
        params = {"type": "none"} if params is None else params
        if not isinstance(params, dict):
            raise TypeError(f"compression params must be a dict like {{'type': '2bit', "
                            f"'threshold': 0.5}}, got {type(params).__name__}")
        kind = str(params.get("type", "none")).lower()
        if kind not in _TYPES:
            raise ValueError(f"unknown gradient compression type {params.get('type')!r}; "
                             f"supported: {list(_TYPES)}")
        unknown = set(params) - {"type", "threshold"}
        if unknown or (kind != "2bit" and "threshold" in params):
            raise ValueError(f"unexpected compression parameters {sorted(unknown) or ['threshold']} "
                             f"for type {kind!r}")
        threshold = float(params.get("threshold", 0.5))
        if not threshold > 0:
            raise ValueError(f"2bit threshold must be positive, got {params.get('threshold')!r}")
        self.type = kind
        self.threshold = threshold
        self.residuals: dict[Any, torch.Tensor] = {}

    def start(self, key: Any, merged: torch.Tensor, name: str) -> tuple[Handle, Finish]:
        """Submit the cross-rank sum of ``merged``; returns (handle, finish).

        ``finish(synchronize(handle))`` is the sum, in ``merged``'s dtype and shape.  Every
        rank must start the same keys (matched by ``name``).
        """
        if self.type == "2bit" and merged.dtype in _FLOATS and merged.numel():
            return self._start_2bit(key, merged, name)
        compressor = {"fp16": Compression.fp16, "bf16": Compression.bf16}.get(
            self.type, Compression.none)
        wire, ctx = compressor.compress(merged)
        handle = collectives.allreduce_async(wire.contiguous(), name=name, op=collectives.Sum)
        return handle, lambda out: compressor.decompress(out, ctx)

    def _start_2bit(self, key: Any, merged: torch.Tensor,
                    name: str) -> tuple[Handle, Finish]:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != merged.shape:
            residual = self.residuals[key] = torch.zeros_like(merged, dtype=torch.float32)
        residual.add_(merged.to(torch.float32))
        t = self.threshold
        pos, neg = residual >= t, residual <= -t
        residual.sub_(pos.to(torch.float32) * t).add_(neg.to(torch.float32) * t)
        codes = pos.to(torch.uint8) * 3 + neg.to(torch.uint8) * 2  # MXNet's 11 / 10 / 00
        packed = _pack(codes.flatten())
        handle = collectives.allgather_async(packed, name=name)
        n, shape, dtype = merged.numel(), merged.shape, merged.dtype

        def finish(gathered: torch.Tensor) -> torch.Tensor:
            codes_all = _unpack(gathered.view(-1, packed.numel()), n)
            counts = (codes_all == 3).sum(0, dtype=torch.int64) - (codes_all == 2).sum(
                0, dtype=torch.int64)
            return (counts.to(torch.float64) * t).to(dtype).view(shape)

        return handle, finish
