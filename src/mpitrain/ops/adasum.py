"""Adasum allreduce: adaptive summation by recursive vector halving and distance doubling.

Semantics (Maleki et al., MLSys 2021; Horovod's ``op=hvd.Adasum``): two ranks' gradients of a
tensor combine as ``Adasum(a, b) = (1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b``; 2^k ranks
combine pairwise up a binary tree over rank numbers, ``((g0 + g1) + (g2 + g3)) + ...`` with
``+`` meaning Adasum.  Each tensor of a fused bucket is combined with its own dot product and
norms.  The result is the same, bit for bit, on every rank.

Algorithm (Horovod's ``adasum.h``, written anew over plain buffers): at distance d = 1, 2, 4,
..., rank r and its partner r^d each hold the same segment of the buffer (r's subtree result
and the partner's); each keeps one half (the lower rank the first), receives the partner's
copy of that half, computes per-tensor partial ``[a.b, |left|^2, |right|^2]`` over it, sums
those partials over the 2d ranks that now hold disjoint pieces of the two subtree results
(a small allreduce), and combines its half in place.  After log2(p) levels every rank holds
1/p of the result; the distance-halving phase sends the pieces back up the tree.  Link bytes
per rank: 2(p-1)/p of the buffer, as a ring allreduce; work: one pass of dot products and one
of combination per level over a shrinking half.

The hierarchical form (``MPITRAIN_ADASUM_HIERARCHICAL=1``) is Horovod's GPU/NCCL form: each
node first *averages* its ranks' gradients (a reduce-scatter, so local rank l owns slice l),
local ranks l of all nodes run the halving/doubling above on slice l over the cross-node
communicator (dot products summed over every local rank of the nodes involved, so each tensor
is still combined as a whole), and the node gathers the slices.  It needs equal node sizes and
a power-of-two number of nodes (Horovod's own conditions).  The default is the flat form over
all ranks, which is what Horovod does for CPU tensors and for every tensor when it is built
without NCCL (mpitrain's ``nccl_built()`` is False), so scripts that follow Horovod's
learning-rate rule (``lr_scaler = hvd.local_size()`` only ``if hvd.nccl_built()``) stay right.

Element types: float32 and float64 are reduced in their own type; float16 and bfloat16 in
float32 working buffers, rounded once at the end (Horovod reduces float16 in float16, rounding
after every level).  Every rank of the group must call this, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from ..core.adasum_layout import AdasumLayoutError, check_layout
from ..core.dtypes import FLOATING, STORAGE
from .group import Group
from .kernels import adasum as kernels
from .kernels import cpu
from .reduction import Reduction
from .slices import balanced

__all__ = ["AdasumLayoutError", "Transport", "allreduce", "check_layout", "reducescatter",
           "vhdd"]

_TAG = 0x0ADA  # the data-plane communicators carry nothing else at the same time


class Transport(Protocol):
    """What the halving/doubling core needs from its ranks (MPI here, threads in tests)."""

    rank: int
    size: int

    def exchange(self, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
        """Send ``send`` to ``peer`` and receive ``recv`` from it, at once."""

    def sum_over_block(self, distance: int, values: np.ndarray) -> None:
        """Sum float64 ``values`` in place over the ranks ``r`` with equal
        ``r // (2 * distance)`` (with every local rank of their nodes, when hierarchical)."""


def vhdd(t: Transport, buf: np.ndarray, tmp: np.ndarray, offsets: np.ndarray,
         lo: int = 0, hi: int | None = None) -> None:
    """Adasum-reduce ``buf[lo:hi]`` in place over the transport's ranks (a power of two).

    Args:
        t: the ranks; every one passes the same ``lo``/``hi`` and ``offsets``.
        buf: float32 or float64 working buffer.
        tmp: scratch of ``buf``'s type, at least ``(hi - lo + 1) // 2`` elements.
        offsets: int64 tensor boundaries in ``buf`` (``offsets[i]`` to ``offsets[i + 1]`` is
            tensor i; the last is the end of the last tensor).
    """
    hi = buf.size if hi is None else hi
    sums = np.empty(3 * (offsets.size - 1), dtype=np.float64)
    parents: list[tuple[int, int]] = []
    distance = 1
    while distance < t.size:
        mid = lo + (hi - lo) // 2
        left = (t.rank & distance) == 0
        keep_lo, keep_hi, give_lo, give_hi = (lo, mid, mid, hi) if left else (mid, hi, lo, mid)
        n = keep_hi - keep_lo
        theirs = tmp[:n]
        t.exchange(buf[give_lo:give_hi], theirs, t.rank ^ distance)
        mine = buf[keep_lo:keep_hi]
        bounds = np.clip(offsets - keep_lo, 0, n)
        kernels.dot_and_norms(mine, theirs, bounds, sums)
        if left:
            t.sum_over_block(distance, sums)
        else:  # the block sums [dot, |left|^2, |right|^2]; this rank's own vector is right
            sums[1::3], sums[2::3] = sums[2::3].copy(), sums[1::3].copy()
            t.sum_over_block(distance, sums)
            sums[1::3], sums[2::3] = sums[2::3].copy(), sums[1::3].copy()
        kernels.combine(mine, theirs, bounds, sums)
        parents.append((lo, hi))
        lo, hi = keep_lo, keep_hi
        distance *= 2
    while parents:
        distance //= 2
        parent_lo, parent_hi = parents.pop()
        other = (hi, parent_hi) if lo == parent_lo else (parent_lo, lo)
        t.exchange(buf[lo:hi], buf[other[0]:other[1]], t.rank ^ distance)
        lo, hi = parent_lo, parent_hi


class _MpiTransport:
    """Exchanges on ``comm``; block sums on communicators split from ``block_of`` by
    ``block_index // (2 * distance)`` (made once, collectively)."""

    def __init__(self, comm: Any, block_of: Any, block_index: int) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._blocks = []
        distance = 1
        while distance < self.size:
            self._blocks.append(block_of.Split(block_index // (2 * distance),
                                               block_of.Get_rank()))
            distance *= 2

    def exchange(self, send: np.ndarray, recv: np.ndarray, peer: int) -> None:
        self.comm.Sendrecv(send, peer, _TAG, recv, peer, _TAG)

    def sum_over_block(self, distance: int, values: np.ndarray) -> None:
        self._blocks[distance.bit_length() - 1].Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)

    def close(self) -> None:
        for c in self._blocks:
            c.Free()
        self._blocks = []


def _transport(group: Group, hierarchical: bool) -> _MpiTransport:
    topo, comms = group.topology, group.comms
    if hierarchical:
        return group.memo("adasum.cross", lambda: _MpiTransport(comms.cross, comms.world,
                                                                topo.node_index))
    return group.memo("adasum.flat", lambda: _MpiTransport(comms.world, comms.world, topo.rank))


def _offsets(counts: Sequence[int], n: int) -> np.ndarray:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(counts, dtype=np.int64), out=offsets[1:])
    if offsets[-1] != n:
        raise ValueError(f"tensor counts {list(counts)} add up to {int(offsets[-1])}, but the "
                         f"buffer holds {n} elements")
    return offsets


def _hierarchical(group: Group, w: np.ndarray, tmp: np.ndarray, offsets: np.ndarray) -> None:
    topo, local = group.topology, group.comms.local
    slices = balanced(w.size, topo.local_size)
    lo, hi = slices[topo.local_rank]
    sizes = [b - a for a, b in slices]
    if topo.local_size > 1:
        mine = tmp[:hi - lo]
        local.Reduce_scatter(w, mine, sizes, op=MPI.SUM)
        np.multiply(mine, w.dtype.type(1.0 / topo.local_size), out=w[lo:hi])
    if topo.num_nodes > 1:
        vhdd(_transport(group, True), w, tmp, offsets, lo, hi)
    if topo.local_size > 1:
        local.Allgatherv(MPI.IN_PLACE, [w, (sizes, [a for a, _ in slices])])


def allreduce(group: Group, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
              how: Reduction, hierarchical: bool | None = None) -> None:
    """Adasum-reduce ``send`` (tensors of ``counts`` elements back to back) into ``recv``.

    Args:
        group: the ranks (a power of two of them, or of nodes when hierarchical).
        send, recv: flat storage arrays of ``how.dtype``; ``recv`` may be ``send``.
        counts: elements of each tensor in the buffer, in order (summing to its size).
        how: ``dtype`` float16, bfloat16, float32 or float64; ``prescale`` and ``postscale``
            multiply the inputs before, the result after; its ``op`` is not read (Adasum).
        hierarchical: average within nodes, Adasum across (default: the configuration's
            ``adasum_hierarchical``).

    Raises:
        TypeError: ``dtype`` is not floating point.
        AdasumLayoutError: the group's layout does not allow Adasum (see :func:`check_layout`).
    """
    dtype, prescale, postscale = how.dtype, how.prescale, how.postscale
    if dtype not in FLOATING:
        raise TypeError(f"op=Adasum needs floating-point tensors, got {dtype}")
    hier = group.config.adasum_hierarchical if hierarchical is None else hierarchical
    check_layout(group.topology, hier)
    n = send.size
    offsets = _offsets(counts, n)
    wide = dtype in ("float16", "bfloat16")
    work_type = np.dtype(np.float64 if dtype == "float64" else np.float32)
    if wide:
        w = group.scratch("adasum.work", n * 4).view(np.float32)
        cpu.widen_into(w, send, dtype, prescale)
    else:
        w = recv
        if prescale != 1.0:
            np.multiply(send, work_type.type(prescale), out=w)
        elif send.ctypes.data != recv.ctypes.data:
            w[...] = send
    if group.size > 1 and n > 0:
        tmp = group.scratch("adasum.tmp", n * work_type.itemsize).view(work_type)
        if hier:
            _hierarchical(group, w, tmp, offsets)
        else:
            vhdd(_transport(group, False), w, tmp, offsets)
    if wide:
        if postscale != 1.0:
            np.multiply(w, np.float32(postscale), out=w)
        cpu.narrow_into(recv, w, dtype)
    elif postscale != 1.0:
        np.multiply(w, work_type.type(postscale), out=w)


def reducescatter(group: Group, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                  how: Reduction) -> None:
    """Adasum-reduce ``send`` as one tensor; keep this rank's block (``counts[rank]`` long).

    Horovod 0.28.1 refuses ``reducescatter(op=Adasum)``; mpitrain defines it as the block of
    the Adasum allreduce, so its dot products span the whole tensor, not just the block.
    """
    full = group.scratch("adasum.reducescatter", send.nbytes).view(STORAGE[how.dtype])
    allreduce(group, send, full, [send.size], how)
    start = sum(counts[:group.rank])
    recv[...] = full[start:start + counts[group.rank]]
