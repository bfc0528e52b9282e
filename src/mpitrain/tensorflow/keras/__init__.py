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
from ...process_sets import ProcessSet, global_process_set
from ...runtime import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from ...session import add_process_set, remove_process_set, shutdown
from ..basics import init
from ..compression import Compression
from ..functions import broadcast_variables
from ..sync_batch_norm import SyncBatchNormalization
from . import callbacks, elastic
from .optimizer_keras3 import DistributedOptimizer
from .values import allgather, allreduce, broadcast, reducescatter

__all__ = [
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
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
