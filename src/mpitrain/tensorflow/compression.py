"""``horovod.tensorflow.compression``'s import path: the compressors live in
:mod:`mpitrain.compression` (the same ones serve torch, TensorFlow and numpy)."""

from ..compression import (
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
