"""``import mpitrain.tensorflow.keras as hvd``: Horovod's Keras API for Keras 3.

``hvd.DistributedOptimizer`` wraps a Keras 3 optimizer; ``hvd.callbacks`` holds
``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateWarmupCallback`` and ``LearningRateScheduleCallback``.  Compile the model with
``jit_compile=False`` (the callbacks enforce it): XLA cannot compile mpitrain's collectives.
"""

from ...collectives import Average, Sum, allgather_object, barrier, broadcast_object
from ...compression import Compression
from ...runtime import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from ..basics import init
from ..functions import broadcast_variables
from ..mpi_ops import allgather, allreduce, broadcast
from ..sync_batch_norm import SyncBatchNormalization
from . import callbacks
from .optimizer import DistributedOptimizer

__all__ = [
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
