"""The Horovod face: every name of ``import mpitrain as hvd``, in ``__all__``.

``mpitrain/__init__.py`` loads this module the first time one of these names is used, so
that ``import mpitrain.runner`` (the launcher, the hostfile tool) never imports torch, numba
or MPI.  Nothing here imports torch either: the collectives take numpy arrays as well as torch
tensors (:mod:`mpitrain.face.tensor_ops`), and the names that exist only for torch
(``TORCH_NAMES``: ``DistributedOptimizer``, ``broadcast_parameters``, ...) are loaded from the
torch face when first used, so a numpy-only environment runs ``hvd.init()`` and
``hvd.allreduce`` without torch installed.  Add a public name here, import and ``__all__``
both (or a ``TORCH_NAMES`` row; a rank or build query goes in :mod:`mpitrain.core.queries`,
which every face shares); the package root needs no edit.  The path of a gradient
continues in ``torch/optimizer.py``, then ``engine/``, then ``ops/``.
"""

from ..collectives import (
    Adasum,
    Average,
    Handle,
    Max,
    Min,
    Product,
    Sum,
    allgather_async,
    allgather_object,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from ..compression import Compression
from ..core import queries
from ..core.dtypes import ReduceOp
from ..core.errors import HorovodInternalError, MpitrainInternalError
from ..core.process_sets import ProcessSet, global_process_set
from ..core.queries import *  # noqa: F403 - the rank and build queries: queries.__all__
from ..core.runtime import is_homogeneous
from ..core.version import __version__
from ..session import add_process_set, init, remove_process_set, shutdown
from .tensor_ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)

# Names only the torch face has: name -> module of mpitrain.torch that defines it.
TORCH_NAMES = {
    "DistributedOptimizer": "optimizer",
    "OptimizerUsageError": "optimizer",
    "DistributedSampler": "sampler",
    "SyncBatchNorm": "sync_batch_norm",
    "broadcast_optimizer_state": "functions",
    "broadcast_parameters": "functions",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "sparse_allreduce_async": "autograd_ops",
}

__all__ = [
    *queries.__all__,
    "Adasum",
    "Average",
    "Compression",
    "Handle",
    "HorovodInternalError",
    "Max",
    "Min",
    "MpitrainInternalError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "__version__",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "global_process_set",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "shutdown",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
