"""``import mpitrain.mxnet as hvd``: Horovod's MXNet API for gluon-style code on torch tensors.

``hvd.DistributedTrainer`` and ``hvd.broadcast_parameters`` come from
:mod:`mpitrain.kvstore.trainer`; the runtime and collectives are mpitrain's own (they take
torch tensors and numpy arrays).  MXNet itself is not needed, nor used.
"""

from .collectives import (
    Average,
    Sum,
    allgather,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    grouped_allreduce,
)
from .compression import Compression
from .core.runtime import is_initialized, local_rank, local_size, rank, size
from .kvstore.trainer import DistributedTrainer, broadcast_parameters
from .kvstore.updater import SGD, Adam, Optimizer
from .session import init, shutdown

__all__ = [
    "SGD",
    "Adam",
    "Average",
    "Compression",
    "DistributedTrainer",
    "Optimizer",
    "Sum",
    "allgather",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_parameters",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
