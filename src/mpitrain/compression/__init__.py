"""Gradient compression, by Horovod's names: ``Compression.none``, ``.fp16``, ``.bf16`` (the
casts of :mod:`mpitrain.collectives.casts`), and ``Compression.powersgd(...)``, ``.topk(...)`` and
``.onebit()``, which make stateful compressors with error feedback
(:mod:`mpitrain.compression.stateful`): objects, one per model, for ``DistributedOptimizer``
and the DDP drop-in's ``register_comm_hook``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..collectives.casts import BF16Compressor, Compressor, FP16Compressor, NoneCompressor

if TYPE_CHECKING:
    from .stateful import OneBit, PowerSGD, TopK


class Compression:
    """The compressors, by Horovod's names; the stateful ones are made by calling."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def powersgd(rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0,
                 batch_same_shape: bool = False) -> PowerSGD:
        """Low-rank compression, torch's ``powerSGD_hook`` step for step (see
        :class:`mpitrain.compression.stateful.PowerSGD`)."""
        from .stateful import PowerSGD  # deferred: torch, which the face loads without

        return PowerSGD(rank, start_iter, min_compression_rate, use_error_feedback,
                        warm_start, orthogonalization_epsilon, seed, batch_same_shape)

    @staticmethod
    def topk(ratio: float = 0.01) -> TopK:
        """The ``ratio`` largest entries of each gradient, with error feedback."""
        from .stateful import TopK  # deferred: torch, which the face loads without

        return TopK(ratio)

    @staticmethod
    def onebit() -> OneBit:
        """Signs and one scale per gradient, with error feedback."""
        from .stateful import OneBit  # deferred: torch, which the face loads without

        return OneBit()


__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
