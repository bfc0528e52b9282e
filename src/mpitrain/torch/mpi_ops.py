"""``horovod.torch.mpi_ops``'s place: the tensor collectives under the module path Horovod
scripts import them from (``from horovod.torch.mpi_ops import allreduce``).

The functions are :mod:`mpitrain.face.tensor_ops`' (numpy arrays and torch tensors alike, autograd
for tensors that require grad, in :mod:`.autograd_ops`); the sparse allreduce is torch's own.
"""

from ..face import tensor_ops
from ..face.tensor_ops import *  # noqa: F403 - the collectives: tensor_ops.__all__
from .autograd_ops import sparse_allreduce_async

__all__ = [*tensor_ops.__all__, "sparse_allreduce_async"]
