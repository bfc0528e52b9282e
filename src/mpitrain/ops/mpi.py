"""MPI's own collectives over plain buffers: the fallback and the small-message path.

Element types MPI cannot reduce (float16, bfloat16) are widened to float32 around the call;
scaling follows :mod:`mpitrain.ops.reference` exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ..core.dtypes import ReduceOp
from . import reference
from .group import Group
from .reduction import Reduction

_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.PRODUCT: MPI.PROD,
}
_BOOL_OPS = {
    ReduceOp.SUM: MPI.LOR,
    ReduceOp.MAX: MPI.LOR,
    ReduceOp.MIN: MPI.LAND,
    ReduceOp.PRODUCT: MPI.LAND,
}


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` and ``b`` are the same buffer (the in-place case)."""
    return a.nbytes == b.nbytes and _address(a) == _address(b)


def _scaled_int(x: np.ndarray, factor: float) -> np.ndarray:
    return reference.scale_int(x, factor)


# Open MPI's vectorised 8- and 16-bit integer sums saturate instead of wrapping; reducing
# these in int64 and narrowing afterwards gives C's wrap-around on every implementation.
_NARROW_INTS = ("uint8", "int8", "int16")


# Min and Max cannot overflow: MPI reduces the narrow integers exactly for them (the
# deterministic mode's exponent fields are one byte per element: widened they would be eight).
_EXACT_ON_NARROW = (ReduceOp.MIN, ReduceOp.MAX)

# Types MPI reduces exactly as the reference does, with no widening.
_NATIVE = frozenset({"int32", "int64", "float32", "float64"})


def _reduce_prepare(send: np.ndarray, dtype: str, prescale: float) -> np.ndarray:
    """Return the operand MPI should reduce: widened and prescaled as needed (maybe a copy)."""
    if dtype in _NARROW_INTS:
        return _scaled_int(send, prescale).astype(np.int64)
    if dtype in ("float16", "bfloat16"):
        work = reference.widen(send, dtype)
        if work is send:
            work = work.copy()
        if prescale != 1.0:
            work *= np.float32(prescale)
        return work
    if prescale == 1.0 or dtype == "bool":
        return send
    if dtype in ("float32", "float64"):
        return send * send.dtype.type(prescale)
    return _scaled_int(send, prescale)


def _reduce_finish(work: np.ndarray, recv: np.ndarray, dtype: str, postscale: float) -> None:
    """Scale the reduced ``work`` and store it into ``recv`` (which may be ``work``)."""
    if dtype in ("float16", "bfloat16"):
        if postscale != 1.0:
            work *= np.float32(postscale)
        recv[...] = reference.narrow(work, dtype)
        return
    if dtype in _NARROW_INTS:
        recv[...] = _scaled_int(work.astype(recv.dtype), postscale)
        return
    if postscale != 1.0 and dtype != "bool":
        if dtype in ("float32", "float64"):
            np.multiply(work, work.dtype.type(postscale), out=recv)
            return
        recv[...] = _scaled_int(work, postscale)
        return
    if not same_memory(work, recv):
        recv[...] = work


def _mpi_op(dtype: str, op: ReduceOp) -> Any:
    return _BOOL_OPS[op] if dtype == "bool" else _MPI_OPS[op]


def allreduce(group: Group, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    """Reduce ``send`` across the group into ``recv`` (``send`` may be ``recv``)."""
    dtype, op, prescale, postscale = how.dtype, how.op, how.prescale, how.postscale
    if prescale == 1.0 and postscale == 1.0 and (
            dtype in _NATIVE or (dtype in _NARROW_INTS and op in _EXACT_ON_NARROW)):
        # The latency path (small messages): straight to MPI, nothing to prepare.
        # Only views (arrays with a base) can be the same memory without being one object.
        if send is recv or ((send.base is not None or recv.base is not None)
                            and same_memory(send, recv)):
            group.comm.Allreduce(MPI.IN_PLACE, recv, op=_MPI_OPS[op])
        else:
            group.comm.Allreduce(send, recv, op=_MPI_OPS[op])
        return
    work = _reduce_prepare(send, dtype, prescale)
    mpi_op = _mpi_op(dtype, op)
    if work is send and not same_memory(send, recv):
        group.comm.Allreduce(send, recv, op=mpi_op)
        work = recv
    else:
        group.comm.Allreduce(MPI.IN_PLACE, work, op=mpi_op)
    _reduce_finish(work, recv, dtype, postscale)


def reducescatter(group: Group, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                  how: Reduction) -> None:
    """Reduce ``send`` across the group; rank i keeps elements of block i (``counts[i]`` long)."""
    dtype, op, prescale, postscale = how.dtype, how.op, how.prescale, how.postscale
    work = _reduce_prepare(send, dtype, prescale)
    mpi_op = _mpi_op(dtype, op)
    if work.dtype != recv.dtype:  # widened: reduce into a widened block, then narrow
        out = np.empty(recv.shape, dtype=work.dtype)
        group.comm.Reduce_scatter(work, out, recvcounts=list(counts), op=mpi_op)
    else:
        out = recv
        group.comm.Reduce_scatter(work, out, recvcounts=list(counts), op=mpi_op)
    _reduce_finish(out, recv, dtype, postscale)


def allgather(group: Group, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
    """Concatenate every rank's ``send`` bytes into ``recv``; ``counts[i]`` bytes from rank i."""
    displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist()
    group.comm.Allgatherv(send.view(np.uint8),
                          [recv.view(np.uint8), list(counts), displs, MPI.BYTE])


def broadcast(group: Group, buf: np.ndarray, root: int) -> None:
    """Copy ``buf`` of rank ``root`` (a rank of the group) into ``buf`` everywhere."""
    group.comm.Bcast([buf.view(np.uint8), MPI.BYTE], root=root)


def alltoall(group: Group, send: np.ndarray, sendcounts: Sequence[int], recv: np.ndarray,
             recvcounts: Sequence[int]) -> None:
    """Send ``sendcounts[j]`` bytes to rank j and receive ``recvcounts[j]`` bytes from it."""
    sdispl = np.concatenate(([0], np.cumsum(sendcounts[:-1]))).astype(np.int64).tolist()
    rdispl = np.concatenate(([0], np.cumsum(recvcounts[:-1]))).astype(np.int64).tolist()
    group.comm.Alltoallv([send.view(np.uint8), list(sendcounts), sdispl, MPI.BYTE],
                         [recv.view(np.uint8), list(recvcounts), rdispl, MPI.BYTE])


def barrier(group: Group) -> None:
    group.comm.Barrier()


def allgather_int(group: Group, value: int) -> list[int]:
    """Every rank's ``value``, in rank order."""
    mine = np.array([value], dtype=np.int64)
    out = np.empty(group.size, dtype=np.int64)
    group.comm.Allgather(mine, out)
    return [int(v) for v in out]


def alltoall_int(group: Group, values: Sequence[int]) -> list[int]:
    """Send ``values[j]`` to rank j; return what each rank sent to this one."""
    mine = np.asarray(values, dtype=np.int64)
    out = np.empty(group.size, dtype=np.int64)
    group.comm.Alltoall(mine, out)
    return [int(v) for v in out]
