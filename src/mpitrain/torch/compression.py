"""``horovod.torch.compression``'s import path: the compressors live in :mod:`mpitrain.compression`.

Scripts written for Horovod import ``Compression`` from here as often as from the face.
"""

from ..compression import (
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
