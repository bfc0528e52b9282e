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
from ..core.errors import HorovodInternalError, MpitrainInternalError
from ..core.process_sets import ProcessSet
from ..core.runtime import is_homogeneous
from ..session import add_process_set, remove_process_set
from . import basics, elastic, keras, util
from .basics import *  # noqa: F403 - init, shutdown and the queries: basics.__all__
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
    *basics.__all__,
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
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_broadcast",
    "grouped_reducescatter",
    "is_homogeneous",
    "join",
    "keras",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "start_timeline",
    "stop_timeline",
    "size_op",
    "util",
]
