"""Parallel channels: one bucket split into parts reduced at the same time.

``MPITRAIN_ALLREDUCE_STREAMS=N`` (alias ``PERSEUS_ALLREDUCE_STREAMS``) cuts a large bucket
into N contiguous parts; part i runs on channel i, a copy of the group on duplicated
communicators (:meth:`mpitrain.ops.group.Group.channels`), part 0 on the calling thread and
the others on a small thread pool.  The kernels release the GIL and MPI's waits do too, so
the parts really overlap: across nodes N rings keep N connections busy; within a node N
slices are reduced by N threads.  Every rank splits the same way, so part i meets part i.

On a CPU-only node whose cores are already taken by the ranks more threads do not help (see
the benchmark), so the default is 1; GPU and multi-NIC setups benefit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .group import Group

# Parts smaller than this are not worth a thread hand-off.
MIN_PART_BYTES = 1 << 20
_ALIGN = 64  # elements; parts start on cache-line multiples for every element size


def parts(n: int, itemsize: int, streams: int) -> list[tuple[int, int]]:
    """Contiguous (start, stop) element ranges for up to ``streams`` channels."""
    usable = max(1, min(streams, (n * itemsize) // MIN_PART_BYTES))
    if usable == 1:
        return [(0, n)]
    size = -(-n // usable)
    size = -(-size // _ALIGN) * _ALIGN
    out = []
    for i in range(usable):
        lo, hi = min(i * size, n), min((i + 1) * size, n)
        if hi > lo:
            out.append((lo, hi))
    return out


def run(group: Group, send: np.ndarray, recv: np.ndarray, streams: int,
        fn: Callable[[Group, np.ndarray, np.ndarray], Any],
        prepare: Callable[[Group], Any] | None = None) -> None:
    """Run ``fn(channel, send_part, recv_part)`` on each part concurrently.

    ``prepare(channel)`` runs first for every channel, one after the other on this thread:
    lazy collective set-up (shared-memory state) then happens in the same order on every
    rank, and slow first-time work (kernel compilation) is not raced by the other channels'
    threads while their peers wait.  Every rank of the group must call this with the same
    length and ``streams``.
    """
    ranges = parts(send.size, send.itemsize, streams)
    if len(ranges) == 1:
        fn(group, send, recv)
        return
    chans = group.channels(len(ranges))
    if prepare is not None:
        for chan in chans:
            prepare(chan)
    pool = group.pool(len(ranges) - 1)
    futures = [pool.submit(fn, chans[i], send[lo:hi], recv[lo:hi])
               for i, (lo, hi) in enumerate(ranges) if i > 0]
    lo, hi = ranges[0]
    error: BaseException | None = None
    try:
        fn(chans[0], send[lo:hi], recv[lo:hi])
    except BaseException as exc:  # still wait for the other parts before raising
        error = exc
    for f in futures:
        try:
            f.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error
