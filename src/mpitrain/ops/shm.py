"""Intra-node collectives in which ranks read each other's buffers directly (single copy).

Transport: every rank publishes the addresses of its input and output buffers once per call
(one small allgather, which also tells everyone that all inputs are ready); peers then read
them with cross-memory attach (:mod:`mpitrain.ops.cma`), so no rank ever copies its data into
a staging segment first and any buffer works, however the caller allocated it.

Allreduce of S bytes over p ranks (rank j owns slice j, S/p bytes):

1. reduce-scatter: rank j reads slice j of every peer's input in cache-sized chunks (the
   kernel copies it into a chunk buffer that stays in cache), reads its own slice j, and
   writes the reduced, scaled chunk straight into slice j of its output.  Memory traffic over
   all ranks: p·S/p·p = p·S bytes read, S written.
2. barrier, then allgather: rank j reads slice q of rank q's output into its own output for
   every q != j: (p-1)·S read and (p-1)·S written over all ranks.
3. barrier, so nobody returns (and reuses its buffers) while a peer still reads them.

Total: p·S + S + 2·(p-1)·S = (3p-1)·S bytes against the 2·p·S floor (every input read once,
every output written once), i.e. 1.25x the floor at p=2 and 1.38x at p=4.  Each slice is
reduced by exactly one rank, in rank order, and then copied, so every rank holds the same
bits.  Slices that the numba kernel reduces run with the GIL released.

Where the kernel refuses cross-memory attach (containers whose seccomp profile blocks
``process_vm_readv``, ``ptrace_scope`` 2 or more), allreduce stages through an MPI-3 shared
window instead: every rank copies its input into its segment (2·p·S), reduces its slice
straight from all segments (p·S read, 2·S written: its output and its segment), then copies
the other slices from their owners' segments (2·(p-1)·S): about 5·p·S in all, 2.5x the floor
but still one pass fewer than sending the data through MPI's shared-memory transport.  The
other collectives then use MPI's own.

Every rank of the node communicator must call these functions, in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from . import cma
from .kernels import cpu
from .reduction import Reduction
from .scratch import Scratch
from .slices import balanced


class Node:
    """The ranks of one node and what they know of each other (process ids, transport)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.pids = comm.allgather(os.getpid())
        # Whether peers can read each other's memory; the group may overrule it (to agree
        # across nodes), so algorithms read ``cma``, set by the owner.
        self.probed = self.size == 1 or cma.probe(comm)
        self.cma = self.probed
        self._scratch = Scratch()
        self._win: Any = None
        self._segments: list[np.ndarray] = []

    def segments(self, nbytes: int) -> list[np.ndarray]:
        """Every rank's byte segment of a shared window of at least ``nbytes`` each.

        Collective (the window is reallocated when a larger message arrives; every rank
        asks for the same size).
        """
        if self._win is None or self._segments[0].nbytes < nbytes:
            self.close()
            size = max(1 << 20, 1 << max(0, nbytes - 1).bit_length())
            self._win = MPI.Win.Allocate_shared(size, 1, comm=self.comm)
            self._segments = []
            for q in range(self.size):
                mem, _unit = self._win.Shared_query(q)
                self._segments.append(np.frombuffer(mem, dtype=np.uint8)[:size])
        return self._segments

    def close(self) -> None:
        """Free the shared window, if any (collective when one exists)."""
        if self._win is not None:
            self._segments = []
            win, self._win = self._win, None
            win.Free()

    def scratch(self, key: str, count: int, dtype: np.dtype) -> np.ndarray:
        return self._scratch.get(key, count, dtype)

    def exchange(self, *buffers: np.ndarray) -> list[tuple[int, ...]]:
        """Every rank's buffer addresses, in rank order (and a point where all have arrived).

        A typed Allgather rather than mpi4py's pickling ``allgather``: this runs on every
        call and its latency is most of the cost of a mid-sized collective.
        """
        k = len(buffers)
        mine = np.fromiter((cma.address(b) for b in buffers), dtype=np.int64, count=k)
        everyone = np.empty(k * self.size, dtype=np.int64)
        self.comm.Allgather(mine, everyone)
        return [tuple(int(v) for v in everyone[q * k:(q + 1) * k]) for q in range(self.size)]

    def barrier(self) -> None:
        self.comm.Barrier()


def _chunk_elems(itemsize: int) -> int:
    return max(1, cpu.CHUNK_BYTES // itemsize)


@dataclass(frozen=True)
class Inputs:
    """Every rank's input to a reduction: this rank's ``send``, and where the peers' lie.

    The peers' are read at ``addresses`` (one per rank, in rank order) by cross-memory
    attach, or, with ``views`` (every rank's data in a shared window), in place.
    """

    send: np.ndarray
    addresses: Sequence[int]
    views: Sequence[np.ndarray] | None = None


def reduce_slice(node: Node, inputs: Inputs, lo: int, hi: int, out: np.ndarray,
                 how: Reduction) -> None:
    """Reduce elements [lo, hi) of every rank's input into ``out``.

    ``out`` holds hi - lo elements and may alias ``inputs.send[lo:hi]`` (in place).
    """
    send, addresses, views, dtype = inputs.send, inputs.addresses, inputs.views, how.dtype
    itemsize = send.dtype.itemsize
    step = _chunk_elems(itemsize)
    acc = node.scratch("acc", min(step, hi - lo), cpu.acc_dtype(dtype))
    tmp = node.scratch("tmp", min(step, hi - lo), np.dtype(np.float32)) \
        if dtype in ("float16", "bfloat16") else None
    peers = node.scratch("peers", (node.size - 1) * min(step, hi - lo), send.dtype)
    for start in range(lo, hi, step):
        stop = min(start + step, hi)
        n = stop - start
        sources = []
        k = 0
        for q in range(node.size):
            if q == node.rank:
                sources.append(send[start:stop])
                continue
            if views is not None:
                sources.append(views[q][start:stop])
                continue
            buf = peers[k * n:(k + 1) * n]
            k += 1
            cma.read(node.pids[q], addresses[q] + start * itemsize, buf)
            sources.append(buf)
        cpu.reduce_chunks(out[start - lo:stop - lo], sources, how, acc, tmp)


def gather_slices(node: Node, recv: np.ndarray, addresses: Sequence[int],
                  ranges: Sequence[tuple[int, int]], skip: int) -> None:
    """Copy range q of rank q's buffer (at ``addresses[q]``) into ``recv``, for q != skip."""
    itemsize = recv.dtype.itemsize
    for q, (lo, hi) in enumerate(ranges):
        if q == skip or hi == lo:
            continue
        cma.read(node.pids[q], addresses[q] + lo * itemsize, recv[lo:hi])


def allreduce(node: Node, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    """Allreduce among the ranks of ``node`` (see the module docstring for the traffic)."""
    if not node.cma:
        _allreduce_window(node, send, recv, how)
        return
    ranges = balanced(send.size, node.size)
    lo, hi = ranges[node.rank]
    addrs = node.exchange(send, recv)
    reduce_slice(node, Inputs(send, [a[0] for a in addrs]), lo, hi, recv[lo:hi], how)
    node.barrier()
    gather_slices(node, recv, [a[1] for a in addrs], ranges, node.rank)
    node.barrier()


def _allreduce_window(node: Node, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    """The staged variant for nodes without cross-memory attach (see the module docstring)."""
    ranges = balanced(send.size, node.size)
    lo, hi = ranges[node.rank]
    views = [seg[:send.nbytes].view(send.dtype) for seg in node.segments(send.nbytes)]
    np.copyto(views[node.rank], send)
    node.barrier()
    mine = views[node.rank]
    reduce_slice(node, Inputs(mine, [], views), lo, hi, recv[lo:hi], how)
    mine[lo:hi] = recv[lo:hi]
    node.barrier()
    for q, (qlo, qhi) in enumerate(ranges):
        if q != node.rank:
            recv[qlo:qhi] = views[q][qlo:qhi]
    node.barrier()


def reducescatter(node: Node, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                  how: Reduction) -> None:
    """Rank i keeps the reduction of elements of block i (``counts[i]`` long) in ``recv``."""
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    lo, hi = int(offsets[node.rank]), int(offsets[node.rank + 1])
    addrs = node.exchange(send)
    reduce_slice(node, Inputs(send, [a[0] for a in addrs]), lo, hi, recv, how)
    node.barrier()


def allgather(node: Node, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
    """Concatenate every rank's ``send`` bytes into ``recv``; ``counts[i]`` bytes from rank i."""
    send8, recv8 = send.view(np.uint8), recv.view(np.uint8)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    ranges = [(int(offsets[q]), int(offsets[q + 1])) for q in range(node.size)]
    lo, hi = ranges[node.rank]
    addrs = node.exchange(send8)
    # Peer q's data starts at its own send buffer, not at offset lo of it.
    shifted = [a[0] - ranges[q][0] for q, a in enumerate(addrs)]
    if hi > lo:
        recv8[lo:hi] = send8[:hi - lo]
    gather_slices(node, recv8, shifted, ranges, node.rank)
    node.barrier()


def broadcast(node: Node, buf: np.ndarray, root: int) -> None:
    """Copy ``buf`` of local rank ``root`` into ``buf`` on every rank of the node."""
    buf8 = buf.view(np.uint8)
    addrs = node.exchange(buf8)
    if node.rank != root and buf8.nbytes:
        cma.read(node.pids[root], addrs[root][0], buf8)
    node.barrier()
