"""Ring allreduce over MPI point-to-point: reduce-scatter, then allgather, pipelined.

The buffer is cut into p chunks (any length; the first ones one element longer).  In p-1
reduce-scatter steps each rank sends one chunk to its right neighbour and folds the chunk
arriving from its left into its own; after them rank r holds the full reduction of chunk
(r+1) mod p, scales it, and p-1 allgather steps pass the finished chunks around.  Every chunk
is cut into segments of :data:`mpitrain.ops.kernels.cpu.CHUNK_BYTES` so that the reduction of
one segment overlaps the transfer of the next.  Each chunk is reduced along one fixed path and
then copied, so every rank ends with the same bits.

Traffic per rank: 2·(p-1)/p·S bytes sent and received, the bandwidth-optimal amount for
ranks that do not share memory; used across nodes and by the hierarchical allreduce.
float16/bfloat16 travel widened to float32 so sums accumulate in float32 as the reference
says; the prescale is fused into that widening (or into a first copy when not in place).

Every rank of ``comm`` must call this, in the same order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ..dtypes import ReduceOp
from .kernels import cpu
from .mpi import same_memory
from .scratch import Scratch
from .slices import balanced

_TAG = 0x5249  # "RI"; the group's communicator carries nothing else concurrently


def _segments(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(s, min(s + step, hi)) for s in range(lo, hi, step)]


def _ring(comm: Any, work: np.ndarray, dtype: str, op: ReduceOp, postscale: float,
          ws: Scratch) -> None:
    """In-place ring allreduce of ``work`` (accumulation type, prescale already applied)."""
    p, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    chunks = balanced(work.size, p)
    step = max(1, cpu.CHUNK_BYTES // work.itemsize)
    biggest = chunks[0][1] - chunks[0][0]
    incoming = ws.get("in", biggest, work.dtype)
    acc = ws.get("acc", min(step, biggest), cpu.acc_dtype(dtype))
    # The workspace is in the accumulation type: reduce it as that type (float16 and
    # bfloat16 arrive here widened to float32).
    kind = "float32" if dtype in ("float16", "bfloat16") else dtype
    for k in range(p - 1):
        send_lo, send_hi = chunks[(r - k) % p]
        recv_lo, recv_hi = chunks[(r - k - 1) % p]
        segs = _segments(recv_lo, recv_hi, step)
        rreqs = [comm.Irecv([incoming[s - recv_lo:e - recv_lo], MPI.BYTE], left, _TAG + i)
                 for i, (s, e) in enumerate(segs)]
        sreqs = [comm.Isend([work[s:e], MPI.BYTE], right, _TAG + i)
                 for i, (s, e) in enumerate(_segments(send_lo, send_hi, step))]
        last = k == p - 2
        for i, (s, e) in enumerate(segs):
            rreqs[i].Wait()
            got = incoming[s - recv_lo:e - recv_lo]
            cpu.reduce_chunks(work[s:e], [got, work[s:e]], kind, op, 1.0,
                              postscale if last else 1.0, acc)
        MPI.Request.Waitall(sreqs)
    for k in range(p - 1):
        send_lo, send_hi = chunks[(r + 1 - k) % p]
        recv_lo, recv_hi = chunks[(r - k) % p]
        comm.Sendrecv([work[send_lo:send_hi], MPI.BYTE], right, _TAG,
                      [work[recv_lo:recv_hi], MPI.BYTE], left, _TAG)


def allreduce(comm: Any, send: np.ndarray, recv: np.ndarray, dtype: str, op: ReduceOp,
              prescale: float = 1.0, postscale: float = 1.0,
              ws: Scratch | None = None) -> None:
    """Ring allreduce of ``send`` into ``recv`` (which may be ``send``) among ``comm``."""
    ws = ws or Scratch()
    p = comm.Get_size()
    n = send.size
    if p == 1:
        local_reduce(send, recv, dtype, op, prescale, postscale, ws)
        return
    widened = dtype in ("float16", "bfloat16")
    if widened:
        work = ws.get("wide", n, np.dtype(np.float32))
        _convert(send, work, dtype, prescale, ws, widen=True)
    else:
        work = recv
        if prescale != 1.0 and dtype != "bool":
            _convert(send, work, dtype, prescale, ws, widen=False)
        elif n and not same_memory(send, recv):
            np.copyto(recv, send)
    _ring(comm, work, dtype, op, postscale, ws)
    if widened:
        _convert(work, recv, dtype, 1.0, ws, widen=False, narrow=True)


def local_reduce(send: np.ndarray, recv: np.ndarray, dtype: str, op: ReduceOp,
                 prescale: float, postscale: float, ws: Scratch) -> None:
    """The allreduce of a group of one: ``recv = post * (pre * send)`` with reduction rounding."""
    step = max(1, cpu.CHUNK_BYTES // 4)
    n = send.size
    acc = ws.get("lacc", min(step, n), cpu.acc_dtype(dtype))
    tmp = ws.get("ltmp", min(step, n), np.dtype(np.float32))
    for s in range(0, n, step):
        e = min(s + step, n)
        cpu.reduce_chunks(recv[s:e], [send[s:e]], dtype, op, prescale, postscale, acc, tmp)


def _convert(src: np.ndarray, dst: np.ndarray, dtype: str, factor: float, ws: Scratch,
             widen: bool, narrow: bool = False) -> None:
    """Chunk-wise ``dst = factor * src`` with type change for float16/bfloat16 if asked."""
    step = max(1, cpu.CHUNK_BYTES // 4)
    n = src.size
    acc = ws.get("cacc", min(step, n), cpu.acc_dtype(dtype))
    tmp = ws.get("ctmp", min(step, n), np.dtype(np.float32))
    for s in range(0, n, step):
        e = min(s + step, n)
        if widen:
            cpu.widen_into(dst[s:e], src[s:e], dtype, factor)
        elif narrow:
            cpu.narrow_into(dst[s:e], src[s:e], dtype)
        else:
            cpu.scale_into(dst[s:e], src[s:e], dtype, factor, acc, tmp)
