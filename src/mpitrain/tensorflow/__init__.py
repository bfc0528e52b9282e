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

from ..collectives import allgather_object, barrier, broadcast_object, start_timeline, stop_timeline
from ..core.errors import HorovodInternalError, MpitrainInternalError
from ..core.runtime import is_homogeneous
from . import elastic, keras, mpi_ops, util
from .compression import Compression
from .distributed_optimizer import DistributedOptimizer
from .functions import broadcast_global_variables, broadcast_variables
from .gradients import GradientReducer
from .hooks import BroadcastGlobalVariablesHook
from .mpi_ops import *  # noqa: F403 - the collectives, their ops and the queries: see __all__
from .sync_batch_norm import SyncBatchNormalization
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .util import executing_eagerly as _executing_eagerly  # noqa: F401 - Horovod's tests call hvd._executing_eagerly()

__all__ = [
    # As in Horovod, this face re-exports mpi_ops (which holds basics' init, shutdown and
    # queries); mpi_ops' own process-set size helpers stay there.
    *(name for name in mpi_ops.__all__ if name not in ("set_rank", "set_size")),
    "BroadcastGlobalVariablesHook",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "GradientReducer",
    "HorovodInternalError",
    "MpitrainInternalError",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "allgather_object",
    "barrier",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "elastic",
    "is_homogeneous",
    "keras",
    "start_timeline",
    "stop_timeline",
    "util",
]
