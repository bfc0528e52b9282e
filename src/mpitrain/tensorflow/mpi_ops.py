"""Horovod's ``horovod.tensorflow.mpi_ops`` names, for code that imports them from here.

The collectives live in :mod:`.reduce_ops`, :mod:`.gather_ops`, :mod:`.broadcast_ops` and
:mod:`.info_ops` (one file per family, each with its gradients); this module gathers them under
the module name Horovod users know, with the queries every TensorFlow face shares
(:mod:`.basics`; Horovod's ``mpi_ops`` has its build queries too).
"""

from ..collectives import Adasum, Average, Max, Min, Product, Sum, join
from ..core.process_sets import ProcessSet
from ..session import add_process_set, remove_process_set
from . import basics
from ._support import set_rank, set_size
from .basics import *  # noqa: F403 - init, shutdown and the queries: basics.__all__
from .broadcast_ops import broadcast, grouped_broadcast
from .functions import broadcast_
from .gather_ops import allgather, alltoall, grouped_allgather
from .info_ops import local_rank_op, local_size_op, process_set_included_op, rank_op, size_op
from .reduce_ops import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter

__all__ = [
    *basics.__all__,
    "Adasum",
    "Average",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_broadcast",
    "grouped_reducescatter",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "set_rank",
    "set_size",
    "size_op",
]
