"""The data plane: collectives over plain numpy buffers and a Group; nothing here knows torch.

The engine calls only the functions exported here.  Algorithm choice lives in
:mod:`mpitrain.ops.algorithms`; one module per algorithm: :mod:`.mpi` (MPI's own),
:mod:`.shm` (single-copy shared memory within a node, over :mod:`.cma`), :mod:`.ring`,
:mod:`.hierarchical`, :mod:`.adasum`; :mod:`.ordered` and :mod:`.fixed_point`, the designs of
``MPITRAIN_DETERMINISTIC`` (routed by :mod:`.deterministic`); :mod:`.channels` splits large
buckets across parallel communicators; :mod:`.reduction` describes one reduction
(:class:`Reduction`, handed down every floor) and a call's :class:`Overrides`;
:mod:`.kernels.cpu` holds the numba reductions, :mod:`.kernels.adasum` Adasum's.
"""

from ..dtypes import FLOATING, INTEGER, STORAGE, ReduceOp, check_reduce_supported, itemsize
from .adasum import AdasumLayoutError, check_layout
from .algorithms import (
    allgather,
    allgather_int,
    allreduce,
    alltoall,
    alltoall_int,
    barrier,
    broadcast,
    reducescatter,
)
from .group import Group
from .reduction import Overrides, Reduction

__all__ = [
    "AdasumLayoutError",
    "FLOATING",
    "INTEGER",
    "STORAGE",
    "Group",
    "Overrides",
    "ReduceOp",
    "Reduction",
    "allgather",
    "allgather_int",
    "allreduce",
    "alltoall",
    "alltoall_int",
    "barrier",
    "broadcast",
    "check_layout",
    "check_reduce_supported",
    "itemsize",
    "reducescatter",
]
