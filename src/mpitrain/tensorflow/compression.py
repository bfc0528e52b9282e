"""Horovod's ``horovod.tensorflow.compression``: compressors that work on TensorFlow tensors.

As in Horovod, the TensorFlow collectives compress each dense tensor with TensorFlow ops before
it leaves (so a ``Compressor`` written for TensorFlow works, and the casts are differentiable
ops of the step) and decompress the result.  ``Compression.fp16`` casts every floating tensor
to float16 (Horovod's rule for TensorFlow, bfloat16 and float64 included) and leaves other
dtypes alone; ``Compression.bf16`` (mpitrain's) casts float32/float64 to bfloat16.  Each is a
subclass of mpitrain's shared compressor of the same name and still compresses numpy arrays and
torch tensors as that one does; :func:`for_tensorflow` gives the TensorFlow variant of a shared
compressor passed to a TensorFlow op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from .. import compression as _shared
from ..compression import Compressor, NoneCompressor


def _is_tf(tensor: Any) -> bool:
    return bool(tf.is_tensor(tensor)) or isinstance(tensor, tf.Variable)


def _narrow(tensor: Any, shared: type[Compressor], wire: tf.DType,
            casts: Callable[[tf.DType], bool]) -> tuple[Any, Any]:
    """A TF tensor of a dtype ``casts`` accepts as ``wire``, its dtype the context; anything
    else as ``shared`` (the numpy/torch compressor of the same name) compresses it."""
    if not _is_tf(tensor):
        return shared.compress(tensor)
    if casts(tensor.dtype):
        return tf.cast(tensor, wire), tensor.dtype
    return tensor, tensor.dtype


def _widen(tensor: Any, ctx: Any, shared: type[Compressor]) -> Any:
    """Undo :func:`_narrow`: back to the dtype it had, where it was cast at all."""
    if not _is_tf(tensor):
        return shared.decompress(tensor, ctx)
    return tf.cast(tensor, ctx) if ctx is not None and ctx != tensor.dtype else tensor


class FP16Compressor(_shared.FP16Compressor):
    """Send floating TensorFlow tensors as float16 (numpy/torch: float32/float64 only)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return _narrow(tensor, _shared.FP16Compressor, tf.float16, lambda d: d.is_floating)

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _widen(tensor, ctx, _shared.FP16Compressor)


class BF16Compressor(_shared.BF16Compressor):
    """Send float32/float64 tensors as bfloat16 (keeps float32's range, coarser precision)."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return _narrow(tensor, _shared.BF16Compressor, tf.bfloat16,
                       lambda d: d in (tf.float32, tf.float64))

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _widen(tensor, ctx, _shared.BF16Compressor)


class Compression:
    """The compressors, by Horovod's names (and mpitrain's bf16)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_TENSORFLOW_VARIANT: dict[type[Compressor], type[Compressor]] = {
    _shared.FP16Compressor: FP16Compressor,
    _shared.BF16Compressor: BF16Compressor,
}


def for_tensorflow(compression: Any) -> type[Compressor]:
    """The compressor a TensorFlow op applies for ``compression``.

    ``mpitrain.Compression.fp16``/``bf16`` (the shared ones, which would pass TensorFlow tensors
    through uncompressed) become this module's; any other Compressor is used as it is.

    Raises:
        TypeError: ``compression`` is not a Compressor class.
    """
    if not (isinstance(compression, type) and issubclass(compression, Compressor)):
        raise TypeError(f"compression must be a Compressor class such as "
                        f"hvd.Compression.fp16, got {compression!r}")
    return _TENSORFLOW_VARIANT.get(compression, compression)


__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor",
           "for_tensorflow"]
