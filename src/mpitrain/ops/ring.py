"""Ring allreduce over MPI point-to-point: reduce-scatter, then allgather, pipelined.

The buffer is cut into p chunks (any length; the first ones one element longer).  In p-1
reduce-scatter steps each rank sends one chunk to its right neighbour and folds the chunk
arriving from its left into its own; after them rank r holds the full reduction of chunk
(r+1) mod p, scales it, and p-1 allgather steps pass the finished chunks around.  Every chunk
is cut into segments of :data:`mpitrain.ops.kernels.cpu.CHUNK_BYTES` so that the reduction of
one segment overlaps the transfer of the next, and the allgather forwards segment by segment,
starting while the reduce-scatter's last step is still arriving.  Each chunk is reduced along
one fixed path and then copied, so every rank ends with the same bits.

Traffic per rank: 2·(p-1)/p·S bytes sent and received, the bandwidth-optimal amount for
ranks that do not share memory; used across nodes and by the hierarchical allreduce.

float16/bfloat16 travel as 16-bit values, as the user chose them (``Compression.fp16``
halves the bytes on the wire): every hop widens what arrives and its own chunk to float32,
combines them there and rounds once to 16 bits before forwarding, NCCL's behaviour.  So a
chunk is rounded p-1 times along its path instead of once; :func:`reference_16bit` is that
arithmetic in numpy, which the tests hold the ring to bit for bit.  The shared-memory
algorithm inside a node, where bytes cost no network, keeps the exact float32 accumulation.

Every rank of ``comm`` must call this, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..core.dtypes import ReduceOp
from . import reference
from .kernels import cpu
from .mpi import same_memory
from .reduction import Reduction
from .scratch import Scratch
from .slices import balanced

_TAG = 0x5249  # "RI" (+ segment); the group's communicator carries nothing else concurrently
_GATHER_TAG = 0x4147  # "AG", below every _TAG + i: MPI keeps one sender's same-tag order
_SIXTEEN_BIT = ("float16", "bfloat16")
# Open MPI moves TCP data only inside MPI calls: computing between two calls for longer than
# this many bytes take lets the peer's transfer stall (1 Gbit/s link: 128 KiB is ~1 ms).
PROGRESS_BYTES = 128 << 10


def _segments(lo: int, hi: int, step: int) -> list[tuple[int, int]]:
    return [(s, min(s + step, hi)) for s in range(lo, hi, step)]


def _ring(comm: Any, work: np.ndarray, how: Reduction, ws: Scratch) -> None:
    """In-place ring allreduce of ``work`` (its prescale already applied: only
    ``how.postscale`` is applied here).

    Reduce-scatter step k sends chunk r-k and folds chunk r-k-1 arriving from the left;
    allgather step k receives chunk r-k and forwards it at step k+1.  Both phases move
    segments, and the allgather starts inside the last reduce-scatter step: each segment of
    the chunk finished there goes out as soon as it is reduced, and every allgather segment
    is forwarded as soon as it arrives, so the link never idles between the phases (the
    allgather's receives are posted before the data comes, so no rendezvous waits on them).
    """
    p, r = comm.Get_size(), comm.Get_rank()
    dtype, last_step = how.dtype, how.postscale_only()
    first_steps = how.unscaled()
    right, left = (r + 1) % p, (r - 1) % p
    chunks = balanced(work.size, p)
    step = max(1, cpu.CHUNK_BYTES // work.itemsize)
    biggest = chunks[0][1] - chunks[0][0]
    incoming = ws.get("in", biggest, work.dtype)
    acc = ws.get("acc", min(step, biggest), cpu.acc_dtype(dtype))
    # 16-bit segments are widened to float32 here, one at a time.
    tmp = (ws.get("tmp", min(step, biggest), np.dtype(np.float32))
           if dtype in _SIXTEEN_BIT else None)

    def segments(chunk: int) -> list[tuple[int, int]]:
        lo, hi = chunks[chunk % p]
        return _segments(lo, hi, step)

    gathered: list[list[Any]] = []  # allgather step k: its receive requests, one per segment
    gather_sends: list[Any] = []
    # The allgather's last step receives chunk r+2, which the last reduce-scatter step is still
    # sending from: it lands in scratch and is copied into place (MPI forbids receiving into
    # a buffer a pending send reads).  Earlier steps' chunks are free by then.
    last_in = ws.get("agin", biggest, work.dtype)
    last_lo = chunks[(r + 2) % p][0]
    for k in range(p - 1):
        send_segs, recv_segs = segments(r - k), segments(r - k - 1)
        recv_lo = chunks[(r - k - 1) % p][0]
        rreqs = [comm.Irecv([incoming[s - recv_lo:e - recv_lo], MPI.BYTE], left, _TAG + i)
                 for i, (s, e) in enumerate(recv_segs)]
        sreqs = [comm.Isend([work[s:e], MPI.BYTE], right, _TAG + i)
                 for i, (s, e) in enumerate(send_segs)]
        last = k == p - 2
        if last:  # post every allgather receive now, in the order the left neighbour sends
            for g in range(p - 1):
                into = (lambda s, e: last_in[s - last_lo:e - last_lo]) if g == p - 2 \
                    else (lambda s, e: work[s:e])
                gathered.append([comm.Irecv([into(s, e), MPI.BYTE], left, _GATHER_TAG)
                                 for s, e in segments(r - g)])
        for i, (s, e) in enumerate(recv_segs):
            rreqs[i].Wait()
            got = incoming[s - recv_lo:e - recv_lo]
            cpu.reduce_chunks(work[s:e], [got, work[s:e]], last_step if last else first_steps,
                              acc, tmp)
            if last:  # this segment of chunk r+1 is final: the allgather's first step
                gather_sends.append(comm.Isend([work[s:e], MPI.BYTE], right, _GATHER_TAG))
        MPI.Request.Waitall(sreqs)
    for g, requests in enumerate(gathered):
        forward = g < p - 2
        for request, (s, e) in zip(requests, segments(r - g)):
            request.Wait()
            if forward:
                gather_sends.append(comm.Isend([work[s:e], MPI.BYTE], right, _GATHER_TAG))
            else:
                work[s:e] = last_in[s - last_lo:e - last_lo]
    MPI.Request.Waitall(gather_sends)


def allreduce_half_duplex(comm: Any, work: np.ndarray, how: Reduction, ws: Scratch,
                          sends_first: bool,
                          produce: Callable[[int, int], None] | None = None) -> None:
    """In-place allreduce of ``work`` between the two ranks of ``comm``, one way at a time.

    The rank with ``sends_first`` sends its whole buffer, segment by segment; the other folds
    each segment into its own as it arrives (float32 for 16-bit values, rounded once, the
    postscale applied) and, once all are in, sends the result back.  Same bytes per rank as
    the ring of two, and the same bits: each element is the one combination of two values.

    Why: on a host whose ranks share a core each (the namespace cluster), a rank that sends
    and receives on one connection at once moved half the bytes per second of one that only
    sends or only receives (a 16 MiB exchange in each direction at 1 Gbit/s, 2 ranks a host:
    547 ms both ways at once, 292 ms one way after the other).  The hierarchical allreduce
    gives half of each node's pairs the other role, so each direction of the link still carries
    the same bytes in both phases.

    ``how.prescale`` must be 1: what ``work`` holds (or ``produce`` puts there) is scaled
    already.

    ``produce(lo, hi)``, if given, is called for every element range before that range of
    ``work`` is first read, in order: the caller may fill ``work`` piece by piece (the
    hierarchical allreduce reduces its node's slice there, so that reduction overlaps the
    network).  Computing in pieces of :data:`PROGRESS_BYTES`, each followed by a call into
    MPI, keeps the transfer moving meanwhile.
    """
    if comm.Get_size() != 2:
        raise ValueError(f"the half-duplex allreduce needs 2 ranks, not {comm.Get_size()}")
    if how.prescale != 1.0:
        raise ValueError(f"the half-duplex allreduce scales only after, got {how}")
    dtype = how.dtype
    n = work.size
    if n == 0:
        return
    peer = 1 - comm.Get_rank()
    segments = _segments(0, n, max(1, cpu.CHUNK_BYTES // work.itemsize))
    piece = max(1, PROGRESS_BYTES // work.itemsize)
    if sends_first:
        sent: list[Any] = []
        for i, (s, e) in enumerate(segments):
            if produce is not None:
                for a, b in _segments(s, e, piece):
                    produce(a, b)
                    if sent:
                        sent[-1].Test()
            sent.append(comm.Isend([work[s:e], MPI.BYTE], peer, _TAG + i))
        MPI.Request.Waitall(sent)
        MPI.Request.Waitall([comm.Irecv([work[s:e], MPI.BYTE], peer, _GATHER_TAG)
                             for s, e in segments])
        return
    incoming = ws.get("pair_in", n, work.dtype)
    acc = ws.get("acc", min(piece, n), cpu.acc_dtype(dtype))
    tmp = ws.get("tmp", min(piece, n), np.dtype(np.float32)) if dtype in _SIXTEEN_BIT else None
    received = [comm.Irecv([incoming[s:e], MPI.BYTE], peer, _TAG + i)
                for i, (s, e) in enumerate(segments)]
    for request, (s, e) in zip(received, segments):
        if produce is not None:
            for a, b in _segments(s, e, piece):
                produce(a, b)
                received[-1].Test()
        request.Wait()
        for a, b in _segments(s, e, piece):
            mine, theirs = work[a:b], incoming[a:b]
            in_rank_order = [theirs, mine] if peer == 0 else [mine, theirs]
            cpu.reduce_chunks(mine, in_rank_order, how, acc, tmp)
            received[-1].Test()
    # Only now the way back: sending each segment as it is reduced would put both directions
    # on the connection at once again.
    MPI.Request.Waitall([comm.Isend([work[s:e], MPI.BYTE], peer, _GATHER_TAG)
                         for s, e in segments])


def allreduce(comm: Any, send: np.ndarray, recv: np.ndarray, how: Reduction,
              ws: Scratch | None = None) -> None:
    """Ring allreduce of ``send`` into ``recv`` (which may be ``send``) among ``comm``."""
    ws = ws or Scratch()
    p = comm.Get_size()
    n = send.size
    if p == 1:
        local_reduce(send, recv, how, ws)
        return
    if how.prescale != 1.0 and how.dtype != "bool":
        _scale(send, recv, how.dtype, how.prescale, ws)
    elif n and not same_memory(send, recv):
        np.copyto(recv, send)
    _ring(comm, recv, how, ws)


def reference_16bit(inputs: list[np.ndarray], dtype: str, op: ReduceOp, prescale: float = 1.0,
                    postscale: float = 1.0) -> np.ndarray:
    """What :func:`allreduce` computes for float16/bfloat16 inputs (one per rank), in numpy.

    Chunk c (of :func:`balanced` cuts) starts at rank c, prescaled and rounded; each later
    rank on the ring folds in its own chunk in float32 and rounds to 16 bits; the last one
    also applies the postscale before rounding.
    """
    if dtype not in _SIXTEEN_BIT:
        raise ValueError(f"reference_16bit models float16/bfloat16, not {dtype!r}")
    p = len(inputs)
    if p == 1:
        return reference.reduce(inputs, dtype, op, prescale, postscale)
    scaled = [reference.reduce([x], dtype, ReduceOp.SUM, prescale) if prescale != 1.0 else x
              for x in inputs]
    out = np.empty_like(inputs[0])
    for c, (lo, hi) in enumerate(balanced(inputs[0].size, p)):
        acc = scaled[c][lo:hi]
        for i in range(1, p):
            last = i == p - 1
            acc = reference.reduce([acc, scaled[(c + i) % p][lo:hi]], dtype, op, 1.0,
                                   postscale if last else 1.0)
        out[lo:hi] = acc
    return out


def local_reduce(send: np.ndarray, recv: np.ndarray, how: Reduction, ws: Scratch) -> None:
    """The allreduce of a group of one: ``recv = post * (pre * send)`` with reduction rounding."""
    step = max(1, cpu.CHUNK_BYTES // 4)
    n = send.size
    acc = ws.get("lacc", min(step, n), cpu.acc_dtype(how.dtype))
    tmp = ws.get("ltmp", min(step, n), np.dtype(np.float32))
    for s in range(0, n, step):
        e = min(s + step, n)
        cpu.reduce_chunks(recv[s:e], [send[s:e]], how, acc, tmp)


def _scale(src: np.ndarray, dst: np.ndarray, dtype: str, factor: float, ws: Scratch) -> None:
    """Chunk-wise ``dst = factor * src`` (one rounding for float16/bfloat16)."""
    step = max(1, cpu.CHUNK_BYTES // 4)
    n = src.size
    acc = ws.get("cacc", min(step, n), cpu.acc_dtype(dtype))
    tmp = ws.get("ctmp", min(step, n), np.dtype(np.float32))
    for s in range(0, n, step):
        e = min(s + step, n)
        cpu.scale_into(dst[s:e], src[s:e], dtype, factor, acc, tmp)
