"""mpitrain: MPI-native data-parallel training with Horovod's API.

    import mpitrain as hvd
    hvd.init()
    ...

This module is the Horovod face for PyTorch (``import mpitrain.torch as hvd`` is the same).
The path of a gradient continues in ``torch/optimizer.py``, then ``engine/``, then ``ops/``.
Importing mpitrain does not start MPI; ``init()`` does.  It does set what MPI reads when it
starts (see ``_mpi.prepare_environment``), so import mpitrain before mpi4py.
"""

from . import _mpi  # noqa: F401 - first: importing it sets what MPI reads when it starts
from .collectives import (
    Adasum,
    Average,
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
from .compression import Compression
from .engine.request import Handle
from .errors import HorovodInternalError, MpitrainInternalError
from .ops.types import ReduceOp
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .runtime import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from .torch.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .torch.functions import broadcast_optimizer_state, broadcast_parameters
from .torch.mpi_ops import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
    sparse_allreduce_async,
)
from .torch.optimizer import DistributedOptimizer, OptimizerUsageError
from .torch.sampler import DistributedSampler
from .torch.sync_batch_norm import SyncBatchNorm
from .version import __version__

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "DistributedSampler",
    "Handle",
    "HorovodInternalError",
    "Max",
    "Min",
    "MpitrainInternalError",
    "OptimizerUsageError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
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
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
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
    "is_initialized",
    "join",
    "latest_checkpoint",
    "load_checkpoint",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "save_checkpoint",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
