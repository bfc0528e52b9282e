"""MXNet's gradient compression for KVStore pushes, and mpitrain's stateful compressors.

``kv.set_gradient_compression(params)`` takes:

* ``{"type": "fp16"}`` / ``{"type": "bf16"}``: floating pushes cast for the wire and back after
  the sum (asynchronous, like an uncompressed push);
* ``{"type": "2bit", "threshold": t}``: MXNet's scheme: each rank adds its gradient to a
  residual kept per key; elements whose residual reaches ``+t`` are sent as ``+t`` (and ``t``
  is taken off the residual), those at or below ``-t`` as ``-t``, all others as 0 and stay in
  the residual for later pushes (error feedback), four elements to a byte.  Quantised values
  cannot be summed in their packed form, so the packed codes are allgathered and every rank
  decodes and sums them, identically;
* ``{"type": "powersgd", "rank": r, "start_iter": n, "min_compression_rate": c}``,
  ``{"type": "topk", "ratio": q}``, ``{"type": "onebit"}``: the compressors of
  :mod:`mpitrain.compression.stateful` (PowerSGD's warm-up counts pushes).

Every stateful one (2bit included) is a :class:`mpitrain.compression.stateful.GradientReducer` asked
for the sum of each push, keyed by the KVStore key; it runs when the push is made (its
exchange has steps that depend on each other), so those pushes do not overlap later work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import collectives
from ..collectives import Handle
from ..compression import Compression
from ..compression.stateful import GradientReducer, OneBit, PowerSGD, TopK, TwoBit, sparse

Finish = Callable[[Any], torch.Tensor]

# type -> the parameters it takes (with defaults)
_TYPES: dict[str, dict[str, Any]] = {
    "none": {}, "fp16": {}, "bf16": {}, "2bit": {"threshold": 0.5},
    "powersgd": {"rank": 1, "start_iter": 1000, "min_compression_rate": 2},
    "topk": {"ratio": 0.01}, "onebit": {},
}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_pack, _unpack = sparse.pack_codes, sparse.unpack_codes  # the 2-bit wire format


class GradientCompression:
    """What a KVStore does to a merged gradient before summing it across ranks.

    Args:
        params: ``None`` or ``{"type": ..., **options}`` (see the module docstring; 2bit's
            ``threshold`` defaults to 0.5 as in MXNet).

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
        unknown = set(params) - {"type"} - set(_TYPES[kind])
        if unknown:
            raise ValueError(f"unexpected compression parameters {sorted(unknown)} for type "
                             f"{kind!r} (it takes {sorted(_TYPES[kind]) or 'none'})")
        options = {**_TYPES[kind], **{k: v for k, v in params.items() if k != "type"}}
        self.type = kind
        self.threshold = float(options.get("threshold", 0.5))
        self.reducer: GradientReducer | None = None
        if kind == "2bit":
            self.reducer = TwoBit(self.threshold)
        elif kind == "powersgd":
            self.reducer = PowerSGD(rank=options["rank"], start_iter=options["start_iter"],
                                    min_compression_rate=options["min_compression_rate"])
        elif kind == "topk":
            self.reducer = TopK(options["ratio"])
        elif kind == "onebit":
            self.reducer = OneBit()

    def start(self, key: Any, merged: torch.Tensor, name: str) -> tuple[Handle | None, Finish]:
        """Start the cross-rank sum of ``merged``; returns (handle, finish).

        ``finish(synchronize(handle))`` is the sum, in ``merged``'s dtype and shape (with no
        handle, the sum is already there: ``finish(None)``).  Every rank must start the same
        keys (matched by ``name``).
        """
        if self.reducer is not None and merged.dtype in _FLOATS and merged.numel():
            total = merged.clone()
            self.reducer.reduce([total], key=str(key), average=False)
            return None, lambda _: total
        compressor = {"fp16": Compression.fp16, "bf16": Compression.bf16}.get(
            self.type, Compression.none)
        wire, ctx = compressor.compress(merged)
        handle = collectives.allreduce_async(wire.contiguous(), name=name, op=collectives.Sum)
        return handle, lambda out: compressor.decompress(out, ctx)
