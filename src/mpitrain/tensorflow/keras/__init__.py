"""``import mpitrain.tensorflow.keras as hvd``: Horovod's Keras API for Keras 3.

``hvd.DistributedOptimizer`` wraps a Keras 3 optimizer; ``hvd.callbacks`` holds
``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateWarmupCallback`` and ``LearningRateScheduleCallback``.  Compile the model with
``jit_compile=False`` (the callbacks enforce it): XLA cannot compile mpitrain's collectives.
"""

from ...collectives import (
    Average,
    Sum,
    allgather_object,
    barrier,
    broadcast_object,
    start_timeline,
    stop_timeline,
)
from ...core.process_sets import ProcessSet
from ...session import add_process_set, remove_process_set
from .. import basics
from ..basics import *  # noqa: F403 - init, shutdown and the queries: basics.__all__
from ..compression import Compression
from ..functions import broadcast_variables
from ..sync_batch_norm import SyncBatchNormalization
from . import callbacks, elastic
from .optimizer_keras3 import DistributedOptimizer
from .values import allgather, allreduce, broadcast, reducescatter

__all__ = [
    *basics.__all__,
    "Average",
    "Compression",
    "DistributedOptimizer",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "SyncBatchNormalization",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "elastic",
    "broadcast_variables",
    "callbacks",
    "reducescatter",
    "remove_process_set",
    "start_timeline",
    "stop_timeline",
]
