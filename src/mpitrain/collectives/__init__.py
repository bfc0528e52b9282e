"""The front door: every collective of the hvd API, the one way from an adapter to the engine.

Adapters (:mod:`mpitrain.torch`, :mod:`mpitrain.tensorflow`, :mod:`mpitrain.kvstore`, the
hvd face) call these functions and never the engine or the data plane.  Every function
validates its arguments at the call (bad input raises ``ValueError`` or ``TypeError`` naming
the value), turns the arrays into engine entries without copying
(:mod:`mpitrain.collectives.arrays`), and
submits one named request.  The ``_async`` forms return a handle for :func:`poll` and
:func:`synchronize`; a trailing underscore means in place.  Autograd lives one layer up, in
:mod:`mpitrain.torch.mpi_ops`.

Every rank of the process set must call each collective, with the same name (or in the same
order when unnamed), the same shapes beyond what the op allows to differ, and the same
arguments; the engine checks this and fails all ranks with a clear error otherwise.

Files: :mod:`.requests` (validation, naming, submission, handles), :mod:`.reduce`
(allreduce, reducescatter), :mod:`.gather` (allgather, broadcast, alltoall, objects),
:mod:`.control` (barrier, join, timeline), :mod:`.buckets` (gradient buckets the engine sizes).
"""

from ..core.errors import MpitrainInternalError
from ..engine.request import Handle
from .control import barrier, barrier_async, join, start_timeline, stop_timeline
from .gather import (
    allgather,
    allgather_async,
    allgather_object,
    alltoall,
    alltoall_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather,
    grouped_allgather_async,
)
from .reduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from .requests import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    as_list,
    check_adasum_layout,
    poll,
    resolve_op,
    scale_factor,
    synchronize,
    wait_now,
)

__all__ = [
    "Handle",
    "Adasum",
    "Average",
    "Max",
    "Min",
    "MpitrainInternalError",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "as_list",
    "barrier",
    "barrier_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "check_adasum_layout",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "resolve_op",
    "scale_factor",
    "start_timeline",
    "stop_timeline",
    "synchronize",
    "wait_now",
]
