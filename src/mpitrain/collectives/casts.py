"""The compressor interface, and the compressors that only cast: what the collectives need.

``FP16Compressor`` and ``BF16Compressor`` halve the bytes of float32/float64 tensors; other
dtypes pass through unchanged.  bfloat16 keeps float32's range (no overflow for large
gradients) at a coarser precision; Horovod has no bf16 compressor.  Users name them through
:class:`mpitrain.compression.Compression`, which also makes the stateful compressors of
:mod:`mpitrain.compression.stateful`; those use the collectives, so they cannot live down here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from .arrays import is_torch, loaded_torch


class Compressor(ABC):
    """Interface: ``compress`` returns (wire tensor, context); ``decompress`` undoes it.

    ``wire_dtype`` names the element type a compressor that only casts sends float32/float64
    tensors as (None for anything else): DistributedOptimizer then keeps 16-bit wire buckets
    and casts into them in place instead of calling ``compress`` per tensor.
    """

    wire_dtype: str | None = None

    @staticmethod
    @abstractmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return the tensor to send and whatever ``decompress`` needs to undo it."""

    @staticmethod
    @abstractmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return ``tensor`` restored to its original form."""


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


def _is_wide_float(tensor: Any) -> bool:
    if is_torch(tensor):
        torch = loaded_torch()
        return tensor.dtype in (torch.float32, torch.float64)
    return isinstance(tensor, np.ndarray) and tensor.dtype in (np.float32, np.float64)


def _narrow(tensor: Any, wire: str, numpy_dtype: Callable[[], Any]) -> tuple[Any, Any]:
    """A float32/float64 ``tensor`` as ``wire`` (torch's dtype of that name; for numpy,
    ``numpy_dtype()``), with its dtype as the context; anything else as it is."""
    if not _is_wide_float(tensor):
        return tensor, None
    if is_torch(tensor):
        return tensor.to(getattr(loaded_torch(), wire)), tensor.dtype
    return tensor.astype(numpy_dtype()), tensor.dtype


def _widen(tensor: Any, ctx: Any) -> Any:
    """Undo :func:`_narrow`: back to the dtype in ``ctx`` (None: it was left as it is)."""
    if ctx is None:
        return tensor
    if is_torch(tensor):
        return tensor.to(ctx)
    return tensor.astype(ctx)


def _numpy_bfloat16() -> Any:
    try:
        import ml_dtypes  # optional: only bf16 compression of numpy arrays needs it
    except ImportError:
        raise TypeError("Compression.bf16 on numpy arrays needs the ml_dtypes package; "
                        "use torch tensors or Compression.fp16") from None
    return ml_dtypes.bfloat16


def numpy_wire_dtype(wire: str) -> Any:
    """numpy's type for a wire dtype name (``float16``; ``bfloat16`` needs ml_dtypes)."""
    return np.float16 if wire == "float16" else _numpy_bfloat16()


class FP16Compressor(Compressor):
    """Send float32/float64 tensors as float16."""

    wire_dtype = "float16"

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return _narrow(tensor, "float16", lambda: np.float16)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _widen(tensor, ctx)


class BF16Compressor(Compressor):
    """Send float32/float64 torch tensors as bfloat16 (numpy arrays need ml_dtypes)."""

    wire_dtype = "bfloat16"

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return _narrow(tensor, "bfloat16", _numpy_bfloat16)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _widen(tensor, ctx)


__all__ = ["BF16Compressor", "Compressor", "FP16Compressor", "NoneCompressor",
           "numpy_wire_dtype"]
