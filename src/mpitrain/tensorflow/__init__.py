"""``import mpitrain.tensorflow as hvd``: Horovod's TensorFlow API on TensorFlow 2 and Keras 3.

Needs the optional extra (``pip install 'mpitrain[tensorflow]'``); ``import mpitrain`` never
imports TensorFlow.  Collectives run through mpitrain's engine on the tensors' numpy values:
eagerly as plain calls, inside ``tf.function`` and ``tf.compat.v1`` graphs as ops that call
``numpy`` code (see :mod:`mpitrain.tensorflow._bridge` for how every rank submits the same
requests and why no session can deadlock on TensorFlow's thread pool).  XLA
(``jit_compile=True``) cannot compile those ops and is refused.
"""

try:
    import tensorflow as _tf  # noqa: F401 - fail here, with the remedy, if it is missing
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError("mpitrain.tensorflow needs TensorFlow: pip install "
                      "'mpitrain[tensorflow]' (tensorflow-cpu >= 2.16 with Keras 3)") from _exc

from ..collectives import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather_object,
    barrier,
    broadcast_object,
    join,
    start_timeline,
    stop_timeline,
)
from ..errors import HorovodInternalError, MpitrainInternalError
from ..process_sets import ProcessSet, global_process_set
from ..runtime import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
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
    size,
)
from ..session import add_process_set, remove_process_set, shutdown
from . import elastic, keras, util
from .basics import init
from .broadcast_ops import broadcast, grouped_broadcast
from .compression import Compression
from .distributed_optimizer import DistributedOptimizer
from .functions import broadcast_, broadcast_global_variables, broadcast_variables
from .gather_ops import allgather, alltoall, grouped_allgather
from .gradients import GradientReducer
from .hooks import BroadcastGlobalVariablesHook
from .info_ops import local_rank_op, local_size_op, process_set_included_op, rank_op, size_op
from .reduce_ops import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter
from .sync_batch_norm import SyncBatchNormalization
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .util import executing_eagerly as _executing_eagerly  # noqa: F401 - Horovod's tests call hvd._executing_eagerly()

__all__ = [
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "GradientReducer",
    "HorovodInternalError",
    "Max",
    "Min",
    "MpitrainInternalError",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "elastic",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_broadcast",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "keras",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
    "size_op",
    "util",
]
