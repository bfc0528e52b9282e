"""Choose an algorithm for each collective, by message size and topology.

Allreduce (``MPITRAIN_ALLREDUCE_ALGORITHM``, default ``auto``):

* below :data:`MPI_MAX_BYTES`, MPI's own Allreduce: it needs one synchronisation where the
  shared-memory algorithms need three, and Open MPI's shared-memory transport is good at
  mid sizes;
* one node: ``shm`` (staged through a shared window where ranks cannot read each other's
  memory directly);
* several nodes: ``hierarchical`` (shared memory inside, a ring per local rank across);
* otherwise ``ring``.

The crossover sizes are measured by ``benchmarks/allreduce.py`` on the 2-core development
machine (the table is in the README).  A forced algorithm that cannot run on this layout
falls back to the nearest one that can (``shm`` across nodes becomes ``hierarchical``;
``hierarchical`` without cross-memory attach becomes ``ring``).

Broadcast and allgather use shared memory on one node from :data:`SHM_MIN_BYTES`;
reducescatter from the allreduce crossover (its shared-memory path is the first half of the
shm allreduce); MPI otherwise.  Every rank computes the same choice from the same
inputs (size, agreed topology, configuration), so the collectives always match.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..dtypes import ReduceOp
from . import adasum, channels, hierarchical, mpi, ring, shm
from .group import Group
from .kernels import cpu
from .mpi import allgather_int, alltoall, alltoall_int, barrier

# Measured crossover (benchmarks/allreduce.py, five runs on the 2-core machine, shared with
# other jobs, see README): the size from which shm/hierarchical beat MPI's Allreduce at every
# larger size came out between 1 MiB and 16 MiB at p=2, p=4 (oversubscribed) and the emulated
# 2x2, 4 MiB in most runs; below 1 MiB MPI won every run.
# Across network namespaces joined by a 10 Gbit/s-shaped link (benchmarks/netns_allreduce.py,
# 2 hosts x 2 ranks) MPI led at 256 KiB and hierarchical was level or ahead from 1 MiB.
MPI_MAX_BYTES = 4 << 20

# Broadcast and allgather through shared memory from this many bytes in total.  Measured:
# Open MPI's shared-memory transport already copies large messages once (CMA), so ours only
# pulls ahead at the largest sizes (p=2: broadcast at 256 MiB, allgather from 4 MiB; p=4:
# broadcast from 16 MiB, allgather at 256 MiB, both within noise below).
SHM_MIN_BYTES = 128 << 20

__all__ = [
    "allgather",
    "allgather_int",
    "allreduce",
    "alltoall",
    "alltoall_int",
    "barrier",
    "broadcast",
    "choose_allreduce",
    "reducescatter",
]


def choose_allreduce(group: Group, nbytes: int, algorithm: str | None = None) -> str:
    """The allreduce algorithm for ``nbytes`` in ``group`` (same answer on every rank).

    Collective the first time a shared-memory algorithm is considered (see ``Group.node``):
    every rank calls it for the same collective.
    """
    algo = algorithm or group.config.allreduce_algorithm
    topo = group.topology
    if topo.size == 1:
        return "ring" if algo != "mpi" else "mpi"  # ring of one: a fused local scaling
    if algo == "auto":
        if nbytes < MPI_MAX_BYTES:
            return "mpi"
        algo = "shm" if topo.num_nodes == 1 else "hierarchical"
    if algo == "shm" and topo.num_nodes > 1:
        algo = "hierarchical"
    if algo == "hierarchical" and not group.node().cma:
        algo = "ring"  # without cross-memory attach the node phases would need staging
    elif algo == "shm":
        group.node()  # agreed once, collectively; shm then stages if it must
    return algo


def _run_allreduce(algo: str, dtype: str, op: ReduceOp, prescale: float,
                   postscale: float) -> channels.Callable[[Group, np.ndarray, np.ndarray], None]:
    def run(g: Group, send: np.ndarray, recv: np.ndarray) -> None:
        if algo == "shm":
            shm.allreduce(g.node(), send, recv, dtype, op, prescale, postscale)
        elif algo == "hierarchical":
            hierarchical.allreduce(g.node(), g.comms.cross, g.topology.is_homogeneous,
                                   g.workspace("cross"), send, recv, dtype, op, prescale,
                                   postscale)
        else:
            ring.allreduce(g.comm, send, recv, dtype, op, prescale, postscale, g.workspace())
    return run


def allreduce(group: Group, send: np.ndarray, recv: np.ndarray, dtype: str, op: ReduceOp,
              prescale: float = 1.0, postscale: float = 1.0, algorithm: str | None = None,
              streams: int | None = None, counts: Sequence[int] | None = None) -> None:
    """Reduce ``send`` across the group into ``recv`` (``send`` may be ``recv``).

    Args:
        algorithm: override of the configured algorithm (benchmarks and tests).
        streams: override of the configured number of parallel channels.
        counts: elements of each tensor fused in ``send`` (default: one tensor); only
            Adasum, which is not elementwise, needs the boundaries (:mod:`.adasum`).
    """
    if op == ReduceOp.ADASUM:
        adasum.allreduce(group, send, recv, [send.size] if counts is None else counts, dtype,
                         prescale, postscale)
        return
    algo = choose_allreduce(group, send.nbytes, algorithm)
    if algo == "mpi":
        mpi.allreduce(group, send, recv, dtype, op, prescale, postscale)
        return
    n_streams = streams or group.config.allreduce_streams

    def prepare(g: Group) -> None:
        if algo in ("shm", "hierarchical"):
            g.node()
        cpu.warm_up([dtype])

    channels.run(group, send, recv, n_streams, _run_allreduce(algo, dtype, op, prescale,
                                                               postscale), prepare)


def _shm_node(group: Group, nbytes: int, min_bytes: int = SHM_MIN_BYTES) -> shm.Node | None:
    """The node state when this collective should go through shared memory."""
    if group.topology.num_nodes != 1 or group.size == 1 or nbytes < min_bytes:
        return None
    if group.config.allreduce_algorithm == "mpi":
        return None
    node: shm.Node = group.node()
    return node if node.cma else None


def reducescatter(group: Group, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                  dtype: str, op: ReduceOp, prescale: float = 1.0,
                  postscale: float = 1.0) -> None:
    """Reduce ``send`` across the group; rank i keeps elements of block i (``counts[i]`` long)."""
    if op == ReduceOp.ADASUM:
        adasum.reducescatter(group, send, recv, counts, dtype, prescale, postscale)
        return
    node = _shm_node(group, send.nbytes, MPI_MAX_BYTES)
    if node is None:
        mpi.reducescatter(group, send, recv, counts, dtype, op, prescale, postscale)
    else:
        shm.reducescatter(node, send, recv, counts, dtype, op, prescale, postscale)


def allgather(group: Group, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
    """Concatenate every rank's ``send`` bytes into ``recv``; ``counts[i]`` bytes from rank i."""
    node = _shm_node(group, recv.nbytes)
    if node is None:
        mpi.allgather(group, send, recv, counts)
    else:
        shm.allgather(node, send, recv, counts)


def broadcast(group: Group, buf: np.ndarray, root: int) -> None:
    """Copy ``buf`` of rank ``root`` (a rank of the group) into ``buf`` everywhere."""
    node = _shm_node(group, buf.nbytes)
    if node is None:
        mpi.broadcast(group, buf, root)
    else:
        shm.broadcast(node, buf, root)
