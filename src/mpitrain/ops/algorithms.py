"""The collectives' algorithms, and which one runs, by message size and topology.

Allreduce (``MPITRAIN_ALLREDUCE_ALGORITHM``, default ``auto``) is chosen from
:data:`ALLREDUCE_TABLE`, rows tried in order (see :func:`choose_allreduce` for why that order):

* below :data:`MPI_MAX_BYTES`, MPI's own Allreduce: it needs one synchronisation where the
  shared-memory algorithms need three, and Open MPI's shared-memory transport is good at
  mid sizes;
* one node: ``shm`` (staged through a shared window where ranks cannot read each other's
  memory directly);
* several nodes: ``hierarchical`` (shared memory inside, a ring per local rank across);
* otherwise ``ring``.

Across nodes the link decides more than the size: there ``auto`` (from
:data:`CALIBRATION_MIN_BYTES` up, 16-bit buffers from :data:`NARROW_CALIBRATION_BYTES`) runs
MPI's own, the table's choice and the ring, a few calls each, on the first allreduces of each
size class and keeps the fastest, agreed on every rank (:mod:`.calibration`;
``MPITRAIN_ALLREDUCE_CALIBRATE=0`` keeps the table).

The crossover sizes are measured by ``benchmarks/allreduce.py`` on the 2-core development
machine (the table is in the README).  A forced algorithm that cannot run on this layout
falls back to the nearest one that can (``shm`` across nodes becomes ``hierarchical``;
``hierarchical`` without cross-memory attach becomes ``ring``).

With ``MPITRAIN_DETERMINISTIC`` set, elementwise floating-point reductions (allreduce and
reducescatter) leave the table for :mod:`.deterministic`, which gives the same bits whatever
would be chosen here.

Broadcast and allgather use shared memory on one node from :data:`SHM_MIN_BYTES`;
reducescatter from the allreduce crossover (its shared-memory path is the first half of the
shm allreduce); MPI otherwise.  Every rank computes the same choice from the same
inputs (size, agreed topology, configuration), so the collectives always match.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.dtypes import ReduceOp
from . import adasum, calibration_cache, channels, deterministic, hierarchical, mpi, ring, shm
from .calibration import Calibration
from .group import Group
from .kernels import cpu
from .mpi import allgather_int, alltoall, alltoall_int, barrier
from .reduction import Overrides, Reduction

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
    "choice_bytes",
    "choose_allreduce",
    "reducescatter",
]

_NO_OVERRIDES = Overrides()


# An algorithm's body: (group or one of its channels, send, recv, how), reducing ``send``
# into ``recv`` over that group.
AllreduceRun = Callable[[Group, np.ndarray, np.ndarray, Reduction], None]


@dataclass(frozen=True)
class AllreduceAlgorithm:
    """One row of :data:`ALLREDUCE_TABLE`."""

    name: str  # as MPITRAIN_ALLREDUCE_ALGORITHM spells it
    # (group, nbytes, requested algorithm) -> whether this row is taken, given that no row
    # above it was; may call group.node(), collective the first time (see choose_allreduce).
    applies: Callable[[Group, int, str], bool]
    run: AllreduceRun
    shared_memory: bool = False  # needs this node's shared-memory state, group.node()
    channelled: bool = True  # split across parallel channels (MPI's own runs whole)


def _mpi_allreduce(g: Group, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    mpi.allreduce(g, send, recv, how)


def _ring_allreduce(g: Group, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    ring.allreduce(g.comm, send, recv, how, g.workspace())


def _shm_allreduce(g: Group, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    shm.allreduce(g.node(), send, recv, how)


def _hierarchical_allreduce(g: Group, send: np.ndarray, recv: np.ndarray,
                            how: Reduction) -> None:
    levels = hierarchical.Hierarchy(g.node(), g.comms.cross, g.topology.is_homogeneous,
                                    g.workspace("cross"), g.config.hierarchical_pipeline,
                                    g.config.hierarchical_half_duplex)
    hierarchical.allreduce(levels, send, recv, how)


def _mpi_applies(group: Group, nbytes: int, requested: str) -> bool:
    """Asked for by name, or ``auto`` with several ranks below the measured crossover."""
    return requested == "mpi" or (requested == "auto" and group.topology.size > 1
                                  and nbytes < MPI_MAX_BYTES)


def _alone(group: Group, nbytes: int, requested: str) -> bool:
    """A world of one, whatever was asked for: a ring of one is a fused local scaling."""
    return group.topology.size == 1


def _one_node(group: Group, nbytes: int, requested: str) -> bool:
    """``shm`` or ``auto`` with every rank on one node."""
    return requested in ("auto", "shm") and group.topology.num_nodes == 1


def _with_cross_memory_attach(group: Group, nbytes: int, requested: str) -> bool:
    """``hierarchical``, or ``shm``/``auto`` across nodes, where peers read each other's memory.

    Without cross-memory attach its node phases would need staging.  Collective the first
    time (``group.node()``); the ``requested`` test comes first so other requests skip it.
    """
    return requested in ("auto", "shm", "hierarchical") and group.node().cma


def _always(group: Group, nbytes: int, requested: str) -> bool:
    """The last row: ``ring`` by name, and the fallback of every row above."""
    return True


ALLREDUCE_TABLE: tuple[AllreduceAlgorithm, ...] = (
    AllreduceAlgorithm("mpi", _mpi_applies, _mpi_allreduce, channelled=False),
    AllreduceAlgorithm("ring", _alone, _ring_allreduce),
    AllreduceAlgorithm("shm", _one_node, _shm_allreduce, shared_memory=True),
    AllreduceAlgorithm("hierarchical", _with_cross_memory_attach, _hierarchical_allreduce,
                       shared_memory=True),
    AllreduceAlgorithm("ring", _always, _ring_allreduce),
)


# Element types MPI cannot reduce: its path (ops/mpi.py) widens them to float32 around the
# call, so it moves twice their bytes and converts them twice.
WIDENED_BY_MPI = ("float16", "bfloat16")

# Across nodes ``auto`` calibrates from these sizes up (bytes as choice_bytes counts them),
# below the one-node crossover MPI_MAX_BYTES too: how far MPI's own is from the link depends
# on the layout (2 namespace hosts x 2 ranks at 1 Gbit/s: MPI at the link's limit from 1 MiB;
# 3 hosts x 2 ranks: hierarchical 1.55x faster than MPI at 1 MiB, 2026-11-27).  16-bit buffers
# from lower still: MPI's path sends twice their bytes.  Measured the same day on 2 x 2: the
# small transformer of benchmarks/compression_training.py, whose fp16 buckets stayed below
# 4 MiB, stepped slower with Compression.fp16 than without (80 vs 66 ms).
CALIBRATION_MIN_BYTES = 1 << 20
NARROW_CALIBRATION_BYTES = 256 << 10


def choice_bytes(nbytes: int, dtype: str) -> int:
    """The size the table and auto's calibration judge a buffer by: its bytes as MPI's own
    path would move them (16-bit types widened).  The table's crossovers were measured on
    float32; measured 2026-11-27 on 3 namespace hosts x 2 ranks at 1 Gbit/s, a 2 MiB float16
    buffer took ~120 ms on MPI's path and ~45 ms on our ring."""
    return nbytes * 2 if dtype in WIDENED_BY_MPI else nbytes


def choose_allreduce(group: Group, nbytes: int, algorithm: str | None = None) -> str:
    """The allreduce algorithm for ``nbytes`` in ``group`` (same answer on every rank).

    The first row of :data:`ALLREDUCE_TABLE` that applies.  The order of the rows is the
    policy; each predicate states only its own condition:

    1. ``mpi`` first, so that asking for it always gets it, and ``auto`` below the crossover
       takes it before any size-blind row can;
    2. ``ring`` for a world of one, before the shared-memory rows: nothing to share, and no
       node state (a collective) is set up for it;
    3. ``shm`` for ``shm`` and a large ``auto`` on one node: it stages through a shared
       window where peers cannot read each other's memory, so it needs no fallback;
    4. ``hierarchical`` for what remains of those (several nodes) and for ``hierarchical``
       itself, on any layout, when cross-memory attach works;
    5. ``ring`` last: asked for by name, or the fallback of rows 3 and 4.

    Collective the first time a shared-memory algorithm is considered (see ``Group.node``):
    every rank calls it for the same collective and evaluates the same rows in the same order
    on the same inputs (size, agreed topology, configuration), so all take part in the
    set-up and all choose the same row.
    """
    return _choose_allreduce(group, nbytes, algorithm).name


def _choose_allreduce(group: Group, nbytes: int, algorithm: str | None) -> AllreduceAlgorithm:
    """As :func:`choose_allreduce`, but the row itself."""
    requested = algorithm or group.config.allreduce_algorithm
    chosen = next(row for row in ALLREDUCE_TABLE if row.applies(group, nbytes, requested))
    if chosen.shared_memory:
        group.node()  # agreed once, collectively; shm then stages if it must
    return chosen


def allreduce(group: Group, send: np.ndarray, recv: np.ndarray, how: Reduction,
              counts: Sequence[int] | None = None, overrides: Overrides | None = None) -> None:
    """Reduce ``send`` across the group into ``recv`` (``send`` may be ``recv``).

    Args:
        how: what is computed (element type, op, factors).
        counts: elements of each tensor fused in ``send`` (default: one tensor); only
            Adasum, which is not elementwise, needs the boundaries (:mod:`.adasum`).
        overrides: of the configured algorithm and number of parallel channels (autotune,
            benchmarks and tests).
    """
    overrides = overrides or _NO_OVERRIDES
    algorithm, streams = overrides.algorithm, overrides.streams
    if how.op == ReduceOp.ADASUM:
        adasum.allreduce(group, send, recv, [send.size] if counts is None else counts, how)
        return
    if deterministic.applies(group, how):
        deterministic.allreduce(_route(group, overrides), send, recv, how)
        return
    narrow = how.dtype in WIDENED_BY_MPI
    nbytes = choice_bytes(send.nbytes, how.dtype)
    algo = _choose_allreduce(group, nbytes, algorithm)
    calibration = _calibration(group, nbytes, algorithm, algo, narrow)
    if calibration is not None:
        decided = calibration.choice(nbytes, narrow)
        if decided is None:
            trial = _ROWS[calibration.next_trial(nbytes, narrow)]
            calibration.run_trial(group.comm, nbytes, trial.name, lambda: _run_row(
                group, trial, send, recv, how, streams), narrow)
            return
        algo = _ROWS[decided]
        if calibration.checking(nbytes, narrow):
            given = algo
            calibration.run_check(group.comm, nbytes, lambda: _run_row(
                group, given, send, recv, how, streams), narrow)
            return
    _run_row(group, algo, send, recv, how, streams)


def _route(group: Group, overrides: Overrides) -> deterministic.Route:
    """Where a deterministic sum's own collectives go (this module's, for its integers)."""
    return deterministic.Route(group, overrides, allreduce, reducescatter)


# One row per name (both "ring" rows run the same body).
_ROWS = {row.name: row for row in ALLREDUCE_TABLE}


def _calibration(group: Group, nbytes: int, algorithm: str | None,
                 chosen: AllreduceAlgorithm, narrow: bool = False) -> Calibration | None:
    """The group's calibration when ``auto`` picks across nodes for this size, else None.

    The same answer on every rank: it depends on the request, the element type, the agreed
    topology and configuration, and the table's (agreed) choice.
    """
    requested = algorithm or group.config.allreduce_algorithm
    if (requested != "auto" or not group.config.allreduce_calibrate
            or group.topology.num_nodes == 1):
        return None
    if chosen.name == "mpi":
        if nbytes < (NARROW_CALIBRATION_BYTES if narrow else CALIBRATION_MIN_BYTES):
            return None
        # Below the one-node crossover: try what the table takes above it as well.
        chosen = _choose_allreduce(group, MPI_MAX_BYTES, requested)
    contenders = tuple(dict.fromkeys(("mpi", chosen.name, "ring")))
    calibration: Calibration = group.memo("calibration",
                                          lambda: _new_calibration(group, contenders))
    return calibration


def _new_calibration(group: Group, contenders: tuple[str, ...]) -> Calibration:
    """A calibration that starts from the choices an earlier run on the same layout and link
    left (:mod:`.calibration_cache`) and records its own there.  Collective."""
    verbose = group.rank == 0 and group.config.logs_info
    calibration = Calibration(contenders, verbose=verbose)
    if not calibration_cache.enabled(group):
        return calibration
    sig = calibration_cache.signature(group)
    link_us = calibration_cache.link_probe(group)
    if verbose:
        _say_link(calibration_cache.stored_link(group, sig), link_us)
    for key, settled in calibration_cache.load(group, sig, link_us).items():
        # Without the time it was decided with, a choice cannot be checked: decide again.
        if settled.choice in contenders and settled.seconds is not None:
            calibration.decided[key] = settled.choice
            calibration.expected[key] = settled.seconds
            calibration.losers[key] = settled.losers & frozenset(contenders)
            if verbose:
                sys.stderr.write(calibration.describe(key) + "\n")
    calibration.on_settle = lambda key, settled: calibration_cache.store(
        group, sig, link_us, key, settled)
    return calibration


def _say_link(stored_us: float | None, probed_us: float) -> None:
    """Tell the log whether the cache's choices for this layout were made on this link."""
    if stored_us is None:
        return
    same = calibration_cache.same_link(stored_us, probed_us)
    sys.stderr.write(f"mpitrain: auto across nodes: link probe {probed_us / 1e3:.1f} ms, the "
                     f"cached choices' {stored_us / 1e3:.1f} ms: "
                     + ("the same link\n" if same else "another link, calibrating afresh\n"))


def _run_row(group: Group, algo: AllreduceAlgorithm, send: np.ndarray, recv: np.ndarray,
             how: Reduction, streams: int | None) -> None:
    """Run one algorithm, across parallel channels where it is channelled."""
    if not algo.channelled:
        algo.run(group, send, recv, how)
        return
    n_streams = streams or group.config.allreduce_streams

    def prepare(g: Group) -> None:
        if algo.shared_memory:
            g.node()
        cpu.warm_up([how.dtype])

    def run(g: Group, send_part: np.ndarray, recv_part: np.ndarray) -> None:
        algo.run(g, send_part, recv_part, how)

    channels.run(group, send, recv, n_streams, run, prepare)


def _shm_node(group: Group, nbytes: int, min_bytes: int = SHM_MIN_BYTES) -> shm.Node | None:
    """The node state when this collective should go through shared memory."""
    if group.topology.num_nodes != 1 or group.size == 1 or nbytes < min_bytes:
        return None
    if group.config.allreduce_algorithm == "mpi":
        return None
    node: shm.Node = group.node()
    return node if node.cma else None


def reducescatter(group: Group, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                  how: Reduction) -> None:
    """Reduce ``send`` across the group; rank i keeps elements of block i (``counts[i]`` long)."""
    if how.op == ReduceOp.ADASUM:
        adasum.reducescatter(group, send, recv, counts, how)
        return
    if deterministic.applies(group, how):
        deterministic.reducescatter(_route(group, _NO_OVERRIDES), send, recv, counts, how)
        return
    node = _shm_node(group, send.nbytes, MPI_MAX_BYTES)
    if node is None:
        mpi.reducescatter(group, send, recv, counts, how)
    else:
        shm.reducescatter(node, send, recv, counts, how)


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
