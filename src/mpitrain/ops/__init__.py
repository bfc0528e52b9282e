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

import os

# Before numba first loads: its error highlighting runs colorama's init() when numba builds
# its typing registry (an error message made at import), and under mpirun, whose ranks write
# to a terminal, colorama then prints a colour reset on stdout at exit -- into every job's
# output, after `mpitrain-info --json`'s JSON too.  A user's own setting wins.
os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")

from ..core.dtypes import FLOATING, INTEGER, STORAGE, ReduceOp, check_reduce_supported, itemsize
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
