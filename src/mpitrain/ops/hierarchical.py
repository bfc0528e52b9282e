"""Hierarchical allreduce: reduce within each node, across nodes in parallel, share within.

On nodes with equal rank counts (the usual layout), with L ranks per node and N nodes:

1. intra-node reduce-scatter through shared memory (:mod:`mpitrain.ops.shm`): local rank l
   ends with slice l of the node's sum in its output buffer;
2. local rank l runs a ring allreduce of slice l with local rank l of every other node, over
   the cross communicator, all L of them at the same time (cross traffic S/L per rank);
3. intra-node allgather of the finished slices through shared memory.

Between two nodes of an even rank count, step 2 goes one way at a time
(:func:`mpitrain.ops.ring.allreduce_half_duplex`: one side sends its slice, the other folds it
in and sends the result back; half the pairs start from each node), and step 1 runs inside it,
piece by piece just before each piece is sent or folded, so the node's reduction overlaps the
network.  Measured on 2 namespace hosts x 2 ranks at 1 Gbit/s, 32 MiB float16: 176-190 ms with
the ring across and step 1 first, 149-160 ms like this (MPI's own float32: 289 ms).  Where
the link is not the bottleneck the ring's two ways at once can be faster (unshaped veth,
32/128 MiB float32: ring 57-69 / 240-256 ms, one way at a time 65-71 / 250-298 ms, same run);
``MPITRAIN_HIERARCHICAL_HALF_DUPLEX=0`` keeps the ring.

Per node, memory traffic is L·S read and S written in step 1 and (L-1)·S read and written in
step 3, (3L-1)·S in all against the node's 2·L·S floor, as :mod:`mpitrain.ops.shm`; the
network carries 2·(N-1)/N·S/L bytes each way per rank, the ring's optimum for S/L bytes,
with all L local ranks sending at once.

Nodes with different rank counts cannot split the buffer the same way on every node, so
there the node's leader (local rank 0) carries the whole node: intra-node allreduce, ring
allreduce among leaders, intra-node broadcast.  Correct on any layout, slower there.

The prescale is applied while reducing inside the node and the postscale once, by the
cross-node ring, so both are fused into passes that happen anyway.  The node partial sums are
stored in the element type itself, and the cross-node ring carries float16/bfloat16 as 16-bit
values rounded once per hop (see :mod:`mpitrain.ops.ring`): half the bytes on the network,
at the price of those roundings.

**Pipelined** (``MPITRAIN_HIERARCHICAL_PIPELINE=K``, K > 1, off by default): the buffer is cut
into K chunks (each at least :data:`MIN_CHUNK_BYTES`) and the three steps overlap: while a
helper thread runs chunk c's cross-node ring, this thread reduces chunk c+1 inside the node and
shares chunk c-1, so the network and the memory work at once instead of in turn (what
NCCL's pipelined algorithms do).  The helper is the only user of the cross communicator while
it runs, the calling thread the only user of the node's; chunks touch disjoint parts of the
buffers, and a node barrier per chunk orders each chunk's sharing after every local rank's
ring (the ranks' sums are the same on every rank, though grouped per chunk, so they differ
from the unpipelined ones by rounding).

Every rank of the group must call this, in the same order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import ring, shm
from .reduction import Reduction
from .scratch import Scratch
from .slices import balanced

MIN_CHUNK_BYTES = 1 << 20  # below this a chunk's barriers and ring latencies dominate


@dataclass(frozen=True)
class Hierarchy:
    """The two levels this rank reduces over, and how the steps run (the same on every rank).

    Attributes:
        node: the shared-memory state of this node's communicator.
        cross: communicator of the ranks with this local rank on every node.
        homogeneous: every node has the same number of ranks.
        ws: ring workspace for the cross communicator.
        pipeline: overlap the steps over this many chunks (0 or 1: one after another).
        half_duplex: between two nodes of an even rank count, step 2 one way at a time.
    """

    node: shm.Node
    cross: Any
    homogeneous: bool
    ws: Scratch
    pipeline: int = 0
    half_duplex: bool = True


def allreduce(h: Hierarchy, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    """Allreduce over ``h.node`` (this node's ranks) and ``h.cross`` (same local rank
    elsewhere)."""
    node, cross = h.node, h.cross
    chunks = min(h.pipeline, send.nbytes // MIN_CHUNK_BYTES)
    if h.homogeneous and chunks > 1:
        _pipelined(h, send, recv, how, chunks)
        return
    if not h.homogeneous:
        shm.allreduce(node, send, recv, how.prescale_only())
        if node.rank == 0:
            ring.allreduce(cross, recv, recv, how.postscale_only(), h.ws)
        shm.broadcast(node, recv, 0)
        return
    ranges = balanced(send.size, node.size)
    lo, hi = ranges[node.rank]
    addrs = node.exchange(send, recv)
    inputs = shm.Inputs(send, [a[0] for a in addrs])

    def reduce_here(start: int, stop: int) -> None:  # step 1 for [lo + start, lo + stop)
        shm.reduce_slice(node, inputs, lo + start, lo + stop, recv[lo + start:lo + stop],
                         how.prescale_only())

    if h.half_duplex and _half_duplex_applies(node, cross):  # step 1 piece by piece, inside 2
        ring.allreduce_half_duplex(cross, recv[lo:hi], how.postscale_only(), h.ws,
                                   sends_first=_sends_first(node, cross), produce=reduce_here)
    else:
        reduce_here(0, hi - lo)
        ring.allreduce(cross, recv[lo:hi], recv[lo:hi], how.postscale_only(), h.ws)
    node.barrier()
    shm.gather_slices(node, recv, [a[1] for a in addrs], ranges, node.rank)
    node.barrier()


def _half_duplex_applies(node: shm.Node, cross: Any) -> bool:
    """Step 2 one way at a time: two nodes with an even number of ranks each.

    Half of each node's ranks send first (:func:`_sends_first`), so both directions of the
    link carry the same bytes at once; with an odd count one direction would carry more.
    """
    return bool(cross.Get_size() == 2 and node.size % 2 == 0)


def _sends_first(node: shm.Node, cross: Any) -> bool:
    return bool(cross.Get_rank() == node.rank % 2)


def _across(h: Hierarchy, work: np.ndarray, how: Reduction) -> None:
    """Step 2 for this local rank's slice: allreduce it in place with the other nodes
    (``how``'s prescale was applied in step 1)."""
    if h.half_duplex and _half_duplex_applies(h.node, h.cross):
        ring.allreduce_half_duplex(h.cross, work, how.postscale_only(), h.ws,
                                   sends_first=_sends_first(h.node, h.cross))
    else:
        ring.allreduce(h.cross, work, work, how.postscale_only(), h.ws)


def _pipelined(h: Hierarchy, send: np.ndarray, recv: np.ndarray, how: Reduction,
               chunks: int) -> None:
    """The homogeneous allreduce with its three steps overlapped over ``chunks`` chunks."""
    node = h.node
    # Every chunk split over the node's ranks, in absolute element ranges.
    owned = [[(start + lo, start + hi) for lo, hi in balanced(stop - start, node.size)]
             for start, stop in balanced(send.size, chunks)]
    addrs = node.exchange(send, recv)
    reduced = [threading.Event() for _ in owned]
    crossed = [threading.Event() for _ in owned]
    failed: list[BaseException] = []

    def across() -> None:  # the helper thread: chunk c's ring once chunk c is reduced here
        try:
            for c, ranges in enumerate(owned):
                reduced[c].wait()
                if failed:
                    return
                lo, hi = ranges[node.rank]
                _across(h, recv[lo:hi], how)
                crossed[c].set()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            failed.append(exc)
        finally:
            for event in crossed:
                event.set()  # nobody waits for a chunk that will not come

    def share(c: int) -> None:  # every local rank's ring of chunk c is done: gather it
        crossed[c].wait()
        if failed:
            raise failed[0]
        node.barrier()
        shm.gather_slices(node, recv, [a[1] for a in addrs], owned[c], node.rank)

    helper = threading.Thread(target=across, name="mpitrain-hierarchical-cross", daemon=True)
    helper.start()
    try:
        for c, ranges in enumerate(owned):
            lo, hi = ranges[node.rank]
            shm.reduce_slice(node, shm.Inputs(send, [a[0] for a in addrs]), lo, hi,
                             recv[lo:hi], how.prescale_only())
            reduced[c].set()
            if c > 0:
                share(c - 1)
        share(len(owned) - 1)
    except BaseException:
        failed.append(RuntimeError("the node-local steps failed"))
        raise
    finally:
        for event in reduced:
            event.set()  # let the helper see the failure and stop
        helper.join()
    if failed:
        raise failed[0]
    node.barrier()  # nobody leaves while a peer still copies from its buffer
