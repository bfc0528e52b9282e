"""``horovod.torch.mpi_ops``'s place: the tensor collectives under the module path Horovod
scripts import them from (``from horovod.torch.mpi_ops import allreduce``).

The functions are :mod:`mpitrain.tensor_ops`' (numpy arrays and torch tensors alike, autograd
for tensors that require grad, in :mod:`.autograd_ops`); the sparse allreduce is torch's own.
"""

from ..tensor_ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .autograd_ops import sparse_allreduce_async

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "reducescatter",
    "sparse_allreduce_async",
]
