"""Stateful gradient compression with error feedback: PowerSGD, scaled sign (1-bit), top-k.

Horovod's compressors (:mod:`mpitrain.compression`: fp16, bf16) map one tensor to a smaller one
and back, with no memory, around an ordinary allreduce.  These keep state between steps (the
error each rank has not yet sent, PowerSGD's warm-started factors) and run their own
collectives, so they are objects, made by ``hvd.Compression.powersgd(...)``,
``hvd.Compression.topk(...)`` and ``hvd.Compression.onebit()``, and handed to
``DistributedOptimizer(compression=...)`` or the DDP drop-in's ``register_comm_hook``.

Every collective goes through the front door (:mod:`mpitrain.collectives`): negotiated, fused,
the same on every rank.  A tensor a compressor cannot take (not floating point, or too small to
gain) is averaged uncompressed alongside, never an error in the middle of training.
"""

from .base import GradientReducer
from .powersgd import PowerSGD
from .sparse import OneBit, TopK, TwoBit

__all__ = ["GradientReducer", "OneBit", "PowerSGD", "TopK", "TwoBit"]
