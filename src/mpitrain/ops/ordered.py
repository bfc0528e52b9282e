"""Rank-order reductions: every element folded over the ranks in rank order, once, on any layout.

``MPITRAIN_DETERMINISTIC=rank-order`` (and every floating-point Min, Max and Product in either
deterministic design).  The result of element i of a Sum is always
``post * (((pre*x0[i] + pre*x1[i]) + pre*x2[i]) + ...)`` accumulated in float32 (float16,
bfloat16, float32) or float64, rounded once to the element type (Min, Max and Product fold the
same way, NaN winning as in :mod:`.reference`): the single-copy shared-memory algorithm's
arithmetic (:mod:`.shm`, whose slices fold their sources in rank order), wherever
the ranks are and however the bucket was cut.  Every fold runs through
:func:`mpitrain.ops.kernels.cpu.reduce_chunks` with the sources in rank order, so all the
paths below give the same bits:

* small buffers (:data:`GATHER_MAX_BYTES` gathered): every rank gathers every input and folds
  them all itself; one collective, p·S bytes received per rank;
* one node with cross-memory attach or a shared window: :func:`mpitrain.ops.shm.allreduce`;
* otherwise a direct reduce-scatter: an all-to-all gives rank j slice j of every rank's input,
  it folds them in rank order, and an allgather shares the slices.  Per rank 2·(p-1)/p·S bytes
  sent and received, the ring's amount, in two collectives; across nodes each rank's slice
  crosses the link once per other node instead of once per node as in the hierarchical
  algorithm, which is what the fixed order costs there.

Every rank of the communicator must call these functions, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from . import shm
from .kernels import cpu
from .reduction import Reduction
from .scratch import Scratch
from .slices import balanced

# Gather everything and fold locally while the gathered bytes stay this small: one collective
# instead of two (measured by benchmarks/deterministic.py; see docs/guide/deterministic.md).
GATHER_MAX_BYTES = 256 << 10


@dataclass(frozen=True)
class Ranks:
    """Who reduces: the communicator, this node's shared-memory state when every rank of it
    is on this node (node ranks are communicator ranks; else None), and its scratch."""

    comm: Any
    node: shm.Node | None
    ws: Scratch


def allreduce(ranks: Ranks, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    """Rank-order reduction of ``send`` over ``ranks`` into ``recv`` (which may be ``send``)."""
    comm, ws = ranks.comm, ranks.ws
    p = comm.Get_size()
    if send.size == 0:
        return
    if p == 1:
        fold(recv, [send], how, ws)
        return
    if p * send.nbytes <= GATHER_MAX_BYTES:
        _gather_fold(comm, send, recv, how, ws)
    elif ranks.node is not None:
        shm.allreduce(ranks.node, send, recv, how)
    else:
        ranges = balanced(send.size, p)
        lo, hi = ranges[comm.Get_rank()]
        reduce_slices(ranks, send, [b - a for a, b in ranges], recv[lo:hi], how)
        _share(comm, recv, ranges)


def reducescatter(ranks: Ranks, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                  how: Reduction) -> None:
    """Rank i keeps the rank-order reduction of block i (``counts[i]`` elements) in ``recv``."""
    if send.size == 0:
        return
    if ranks.comm.Get_size() == 1:
        fold(recv, [send], how, ranks.ws)
    elif ranks.node is not None:
        shm.reducescatter(ranks.node, send, recv, counts, how)
    else:
        reduce_slices(ranks, send, counts, recv, how)


def fold(out: np.ndarray, sources: Sequence[np.ndarray], how: Reduction, ws: Scratch) -> None:
    """``out = post * OP-fold(pre * sources)``, sources in rank order, chunk by chunk."""
    n = out.size
    step = max(1, cpu.CHUNK_BYTES // out.itemsize)
    acc = ws.get("ordered.acc", min(step, n), cpu.acc_dtype(how.dtype))
    tmp = ws.get("ordered.tmp", min(step, n), np.dtype(np.float32))
    for s in range(0, n, step):
        e = min(s + step, n)
        cpu.reduce_chunks(out[s:e], [x[s:e] for x in sources], how, acc, tmp)


def _gather_fold(comm: Any, send: np.ndarray, recv: np.ndarray, how: Reduction,
                 ws: Scratch) -> None:
    p, n = comm.Get_size(), send.size
    gathered = ws.get("ordered.gathered", p * n, send.dtype)[:p * n]
    comm.Allgather([send.view(np.uint8), MPI.BYTE], [gathered.view(np.uint8), MPI.BYTE])
    fold(recv, [gathered[r * n:(r + 1) * n] for r in range(p)], how, ws)


def reduce_slices(ranks: Ranks, send: np.ndarray, counts: Sequence[int], out: np.ndarray,
                  how: Reduction) -> None:
    """The direct reduce-scatter: rank j folds block j (``counts[j]`` long) of every rank."""
    comm, ws = ranks.comm, ranks.ws
    p, r = comm.Get_size(), comm.Get_rank()
    size = send.itemsize
    mine = counts[r]
    displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64)
    incoming = ws.get("ordered.in", p * mine, send.dtype)[:p * mine]
    comm.Alltoallv([send.view(np.uint8), [c * size for c in counts],
                    [int(d) * size for d in displs], MPI.BYTE],
                   [incoming.view(np.uint8), [mine * size] * p,
                    [q * mine * size for q in range(p)], MPI.BYTE])
    if mine:
        fold(out, [incoming[q * mine:(q + 1) * mine] for q in range(p)], how, ws)


def _share(comm: Any, recv: np.ndarray, ranges: Sequence[tuple[int, int]]) -> None:
    size = recv.itemsize
    comm.Allgatherv(MPI.IN_PLACE, [recv.view(np.uint8), [(b - a) * size for a, b in ranges],
                                   [a * size for a, _ in ranges], MPI.BYTE])
