"""Every allreduce algorithm x dtype x op x length against the numpy reference, in-process.

One MPI job per topology loops over the whole matrix (starting a job per case would take
minutes); the algorithms are called directly on a Group built like the engine builds it, so
every algorithm is exercised whatever ``auto`` would pick.  Results must also be bitwise
identical on every rank.
"""

import os
import zlib

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.core import config as config_mod
from mpitrain.core import topology
from mpitrain.core.dtypes import STORAGE, ReduceOp
from mpitrain.ops import algorithms, reference, shm
from mpitrain.ops.group import Group
from mpitrain.ops.reduction import Overrides, Reduction

# Four ranks run as 2x2 (every algorithm, intra- and inter-node); np3 covers an odd number
# of ranks on one node, 3=2+1 uneven nodes.
MPI_CONFIGS = ("np1", "np2", "np3", "2x2", "3=2+1")

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
DTYPES = list(STORAGE)
OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
# 0, 1, primes, lengths not divisible by 2, 3 or 4, and one that spans many kernel chunks.
LENGTHS = [0, 1, 7, 1009, 300_007]
IN_PLACE_LENGTHS = [0, 7, 1009]  # in place the same code runs with aliased buffers
ALGORITHMS = ["mpi", "shm", "ring", "hierarchical"]


@pytest.fixture(scope="module")
def group():
    cfg = config_mod.load()
    topo, comms = topology.build(WORLD.Dup(), cfg.local_size)
    g = Group(comms, topo, cfg)
    yield g
    g.close()


def values(rank: int, n: int, dtype: str, op: ReduceOp) -> np.ndarray:
    gen = np.random.default_rng(7919 * rank + n + 31 * DTYPES.index(dtype))
    if dtype == "bool":
        return gen.random(n) > 0.5
    if dtype in ("uint8", "int8", "int16", "int32", "int64"):
        low, high = (-3, 4) if op == ReduceOp.PRODUCT else (-120, 120)
        if dtype == "uint8":
            low, high = 0, 200
        return gen.integers(low, high, n).astype(STORAGE[dtype])
    data = gen.normal(size=n).astype(np.float32)
    if op == ReduceOp.PRODUCT:
        data = (0.5 + np.abs(data)).astype(np.float32)
    if dtype == "bfloat16":
        return reference.f32_to_bf16(data)
    return data.astype(STORAGE[dtype])


def check(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        g = reference.widen(got, dtype).astype(np.float64)
        w = reference.widen(want, dtype).astype(np.float64)
        tol = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def same_everywhere(group: Group, data: np.ndarray) -> bool:
    digest = zlib.crc32(np.ascontiguousarray(data).view(np.uint8).tobytes())
    return len(set(WORLD.allgather(digest))) == 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_matrix(group, algorithm, in_place):
    for dtype in DTYPES:
        for op in OPS:
            scales = [(1.0, 1.0)] if dtype == "bool" else [(1.0, 1.0), (0.5, 3.0)]
            for pre, post in scales:
                for n in IN_PLACE_LENGTHS if in_place else LENGTHS:
                    if n > 2000 and (op != ReduceOp.SUM or dtype in ("int16", "uint8")):
                        continue  # the long case once per dtype is enough
                    send = values(RANK, n, dtype, op)
                    recv = send if in_place else np.full_like(send, 1)
                    algorithms.allreduce(group, send, recv, Reduction(dtype, pre, post, op),
                                         overrides=Overrides(algorithm=algorithm))
                    want = reference.reduce([values(r, n, dtype, op) for r in range(SIZE)],
                                            dtype, op, pre, post)
                    what = f"{algorithm} {dtype} {op.name} n={n} pre={pre} post={post}"
                    check(recv, want, dtype, what)
                    assert same_everywhere(group, recv), what


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ring_carries_16_bit_values_bit_for_bit(group, dtype):
    # The ring sends float16/bfloat16 as they are (half the bytes of float32) and rounds once
    # per hop; ring.reference_16bit is that arithmetic in numpy, to the bit, on every rank.
    from mpitrain.ops import ring
    for op in OPS:
        for pre, post in [(1.0, 1.0), (0.5, 3.0)]:
            for n in [7, 1009, 300_007]:
                if n > 2000 and op != ReduceOp.SUM:
                    continue
                send = values(RANK, n, dtype, op)
                recv = np.empty_like(send)
                algorithms.allreduce(group, send, recv, Reduction(dtype, pre, post, op),
                                     overrides=Overrides(algorithm="ring"))
                want = ring.reference_16bit([values(r, n, dtype, op) for r in range(SIZE)],
                                            dtype, op, pre, post)
                what = f"ring {dtype} {op.name} n={n} pre={pre} post={post}"
                np.testing.assert_array_equal(recv.view(np.uint16), want.view(np.uint16), what)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_ring_with_several_segments_per_chunk(group, dtype):
    # Every chunk spans several segments (1 MiB each), so the allgather's forwarding segment by
    # segment, started inside the last reduce-scatter step, runs through every step at p >= 3.
    from mpitrain.ops import ring
    n = 800_011 * SIZE
    send = values(RANK, n, dtype, ReduceOp.SUM)
    recv = np.empty_like(send)
    algorithms.allreduce(group, send, recv, Reduction(dtype, 1.0, 0.5, ReduceOp.SUM),
                         overrides=Overrides(algorithm="ring"))
    inputs = [values(r, n, dtype, ReduceOp.SUM) for r in range(SIZE)]
    if dtype == "float16":
        want = ring.reference_16bit(inputs, dtype, ReduceOp.SUM, 1.0, 0.5)
        np.testing.assert_array_equal(recv.view(np.uint16), want.view(np.uint16))
    else:
        check(recv, reference.reduce(inputs, dtype, ReduceOp.SUM, 1.0, 0.5), dtype, "ring")
    assert same_everywhere(group, recv)


@pytest.mark.skipif(SIZE % 2, reason="pairs of ranks")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int32"])
def test_half_duplex_pair_gives_the_rings_bits(dtype):
    # Two nodes of an even rank count exchange one way at a time (ring.allreduce_half_duplex):
    # the same bits as the ring of two, whichever rank sends first, on both ranks; one
    # segment, several (1 MiB each, the last short) and none.
    from mpitrain.ops import ring
    from mpitrain.ops.scratch import Scratch
    pair = WORLD.Split(RANK // 2, RANK)
    try:
        for op in OPS:
            for post in (1.0, 0.5):
                for n in [0, 7, 1009, 600_011]:
                    if n > 2000 and op != ReduceOp.SUM:
                        continue
                    mine = values(RANK, n, dtype, op)
                    want = mine.copy()
                    ring.allreduce(pair, want, want, Reduction(dtype, 1.0, post, op), Scratch())
                    for first in (0, 1):
                        got = mine.copy()
                        ring.allreduce_half_duplex(pair, got, Reduction(dtype, 1.0, post, op),
                                                   Scratch(), sends_first=pair.Get_rank() == first)
                        what = f"{dtype} {op.name} n={n} post={post} first={first}"
                        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                                      what)
                    # produce: the buffer filled piece by piece, each piece once, in order,
                    # before it is sent or folded (as the hierarchical allreduce fills it).
                    got, produced = np.zeros_like(mine), []

                    def fill(lo, hi, got=got, mine=mine, produced=produced):
                        assert lo == (produced[-1][1] if produced else 0), (lo, produced)
                        got[lo:hi] = mine[lo:hi]
                        produced.append((lo, hi))

                    ring.allreduce_half_duplex(pair, got, Reduction(dtype, 1.0, post, op),
                                               Scratch(), sends_first=pair.Get_rank() == 0,
                                               produce=fill)
                    assert (produced[-1][1] if produced else 0) == n
                    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                                  f"{dtype} {op.name} n={n} produced")
    finally:
        pair.Free()
    with pytest.raises(ValueError, match="needs 2 ranks, not 1"):
        ring.allreduce_half_duplex(MPI.COMM_SELF, np.ones(3, np.float32),
                                   Reduction("float32", 1.0, 1.0, ReduceOp.SUM), Scratch(),
                                   sends_first=True)


def test_16_bit_ring_reference_differs_from_exact_accumulation():
    # A negative control for the test above: with enough ranks to round more than once, the
    # 16-bit ring is not the float32-accumulating reference (so the test can tell them apart).
    from mpitrain.ops import ring
    gen = np.random.default_rng(5)
    inputs = [gen.normal(size=4096).astype(np.float16) for _ in range(4)]
    exact = reference.reduce(inputs, "float16", ReduceOp.SUM)
    hops = ring.reference_16bit(inputs, "float16", ReduceOp.SUM)
    assert not np.array_equal(exact, hops)
    np.testing.assert_allclose(hops.astype(np.float32), exact.astype(np.float32),
                               rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("streams", [2, 3])
def test_channels_split_large_buckets(group, streams):
    n = (3 << 20) // 4 + 5  # three channel parts of at least 1 MiB, not evenly divisible
    for algorithm in ("shm", "ring", "hierarchical"):
        send = values(RANK, n, "float32", ReduceOp.SUM)
        recv = np.empty_like(send)
        algorithms.allreduce(group, send, recv, Reduction("float32", 1.0, 0.25, ReduceOp.SUM),
                             overrides=Overrides(algorithm=algorithm, streams=streams))
        want = reference.reduce([values(r, n, "float32", ReduceOp.SUM) for r in range(SIZE)],
                                "float32", ReduceOp.SUM, 1.0, 0.25)
        check(recv, want, "float32", f"{algorithm} streams={streams}")
        assert same_everywhere(group, recv)


def shm_paths(group):
    """The ways to run broadcast/allgather/reducescatter here: the selected one, and the
    shared-memory one directly where it applies (auto only takes it for large messages)."""
    paths = [("selected", None)]
    if group.topology.num_nodes == 1 and SIZE > 1 and group.node().cma:
        paths.append(("shm", group.node()))
    return paths


@pytest.mark.parametrize("nbytes", [0, 13, 1 << 20])
def test_allgather_broadcast(group, nbytes):
    for path, node in shm_paths(group):
        counts = [nbytes + 3 * r for r in range(SIZE)]
        send = np.full(counts[RANK], RANK + 1, dtype=np.uint8)
        recv = np.zeros(sum(counts), dtype=np.uint8)
        if node is None:
            algorithms.allgather(group, send, recv, counts)
        else:
            shm.allgather(node, send, recv, counts)
        want = np.concatenate([np.full(c, r + 1, dtype=np.uint8) for r, c in enumerate(counts)])
        np.testing.assert_array_equal(recv, want, err_msg=path)
        for root in range(SIZE):
            buf = np.full(nbytes, RANK + 7, dtype=np.uint8)
            if node is None:
                algorithms.broadcast(group, buf, root)
            else:
                shm.broadcast(node, buf, root)
            np.testing.assert_array_equal(buf, np.full(nbytes, root + 7, dtype=np.uint8),
                                          err_msg=path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("n", [5, 400_003])
def test_reducescatter(group, dtype, n):
    for path, node in shm_paths(group):
        counts = [n // SIZE + (1 if r < n % SIZE else 0) for r in range(SIZE)]
        send = values(RANK, n, dtype, ReduceOp.SUM)
        recv = np.empty(counts[RANK], dtype=send.dtype)
        if node is None:
            algorithms.reducescatter(group, send, recv, counts,
                                     Reduction(dtype, 2.0, 0.5, ReduceOp.SUM))
        else:
            shm.reducescatter(node, send, recv, counts, Reduction(dtype, 2.0, 0.5, ReduceOp.SUM))
        full = reference.reduce([values(r, n, dtype, ReduceOp.SUM) for r in range(SIZE)],
                                dtype, ReduceOp.SUM, 2.0, 0.5)
        lo = sum(counts[:RANK])
        check(recv, full[lo:lo + counts[RANK]], dtype, f"reducescatter {path} {dtype} n={n}")


def test_auto_calibrates_across_nodes_and_agrees(group):
    # Across nodes, auto's first large allreduces of a size class are trials of each
    # contender (every one a correct allreduce), and a second look where they leave MPI's
    # own; then all ranks keep the same one.
    from mpitrain.ops.calibration import TRIALS, calls_to_decide
    n = (8 << 20) // 4 + 3
    send = values(RANK, n, "float32", ReduceOp.SUM)
    want = reference.reduce([values(r, n, "float32", ReduceOp.SUM) for r in range(SIZE)],
                            "float32", ReduceOp.SUM)
    calls = calls_to_decide(3) + 2
    for i in range(calls):
        recv = np.empty_like(send)
        algorithms.allreduce(group, send, recv, Reduction("float32", op=ReduceOp.SUM),
                             overrides=Overrides(algorithm="auto"))
        check(recv, want, "float32", f"auto allreduce {i}")
        assert same_everywhere(group, recv)
    calibration = group.memo("calibration", lambda: None)
    if group.topology.num_nodes == 1:
        assert calibration is None  # one node keeps the measured table (shm)
        return
    decided = calibration.choice(send.nbytes)
    assert decided in calibration.contenders
    assert len(set(WORLD.allgather(decided))) == 1
    trials = calibration.trials[calibration.size_class(send.nbytes)]
    second_look = 2 * TRIALS if calibration.provisional.get(
        calibration.size_class(send.nbytes)) else 0
    # Plain losers are cut short (see mpitrain.ops.calibration): at most the full count.
    assert 2 * len(calibration.contenders) <= len(trials)
    assert len(trials) <= TRIALS * len(calibration.contenders) + second_look
    assert len(set(WORLD.allgather(tuple(trials)))) == 1  # the same agreed times everywhere


def test_auto_calibrates_below_the_crossover_across_nodes(group):
    # Across nodes auto calibrates below the one-node crossover (4 MiB) too: float32 from
    # 1 MiB, float16 (which MPI's own path widens, twice the bytes) from 256 KiB widened.  A
    # float16 buffer of 600 KB widened is calibrated; float32 of that size is not.
    from mpitrain.ops.calibration import TRIALS, Calibration, calls_to_decide
    n = 150_001
    send = values(RANK, n, "float16", ReduceOp.SUM)
    inputs = [values(r, n, "float16", ReduceOp.SUM) for r in range(SIZE)]
    for i in range(calls_to_decide(3) + 2):
        recv = np.empty_like(send)
        algorithms.allreduce(group, send, recv, Reduction("float16", op=ReduceOp.SUM),
                             overrides=Overrides(algorithm="auto"))
        check(recv, reference.reduce(inputs, "float16", ReduceOp.SUM), "float16", f"call {i}")
        assert same_everywhere(group, recv)
    small32 = values(RANK, n, "float32", ReduceOp.SUM)
    algorithms.allreduce(group, small32, np.empty_like(small32),
                         Reduction("float32", op=ReduceOp.SUM),
                         overrides=Overrides(algorithm="auto"))
    calibration = group.memo("calibration", lambda: None)
    if group.topology.num_nodes == 1:
        assert calibration is None
        return
    narrow = Calibration.size_class(algorithms.choice_bytes(send.nbytes, "float16"), True)
    second_look = 2 * TRIALS if calibration.provisional.get(narrow) else 0
    assert len(calibration.trials[narrow]) <= TRIALS * len(calibration.contenders) + second_look
    assert calibration.decided[narrow] in calibration.contenders
    assert len(set(WORLD.allgather(calibration.decided[narrow]))) == 1
    assert Calibration.size_class(small32.nbytes) not in calibration.trials


def test_a_second_run_starts_from_the_cached_choices(tmp_path_factory, monkeypatch):
    # Two "runs" (fresh groups) sharing a cache file: the first calibrates and records its
    # decision, the second starts decided (no trials) and runs the same algorithm.  The link
    # probe is pinned: on 3 ranks over 2 busy cores it moved by more than the tolerance
    # between the runs (the real probe's agreement is unit-tested), and so is the check of a
    # given choice against its stored time (unit-tested too): it runs, and keeps the choice.
    import dataclasses

    from mpitrain.ops import calibration as calibration_mod
    from mpitrain.ops import calibration_cache
    from mpitrain.ops.calibration import calls_to_decide

    where = WORLD.bcast(str(tmp_path_factory.mktemp("cache")) if RANK == 0 else None, root=0)
    monkeypatch.setattr(calibration_cache, "link_probe", lambda group: 1234.0)
    monkeypatch.setattr(calibration_mod, "CHECK_TOLERANCE", 1e9)
    cfg = dataclasses.replace(config_mod.load(), calibration_cache=f"{where}/choices.json")
    n = (8 << 20) // 4
    send = values(RANK, n, "float32", ReduceOp.SUM)
    decisions = []
    for run in range(2):
        topo, comms = topology.build(WORLD.Dup(), cfg.local_size)
        g = Group(comms, topo, cfg)
        try:
            for _ in range(calls_to_decide(3) if run == 0 else 2):
                algorithms.allreduce(g, send, np.empty_like(send),
                                     Reduction("float32", op=ReduceOp.SUM),
                                     overrides=Overrides(algorithm="auto"))
            calibration = g.memo("calibration", lambda: None)
            if topo.num_nodes == 1:
                assert calibration is None
                return
            key = calibration.size_class(send.nbytes)
            decisions.append(calibration.decided[key])
            assert (key in calibration.trials) == (run == 0)
            assert (key in calibration.checks) == (run == 1)
        finally:
            g.close()
    assert decisions[0] == decisions[1]
    if RANK == 0:
        path = calibration_cache.cache_path(g)
        assert path is not None and oct(path.stat().st_mode & 0o777) == "0o600"


def test_auto_picks_by_size_and_layout(group):
    small = algorithms.choose_allreduce(group, 8, "auto")
    large = algorithms.choose_allreduce(group, 64 << 20, "auto")
    if SIZE == 1:
        assert large == "ring"
        return
    assert small == "mpi"
    multi_node = group.topology.num_nodes > 1
    assert large == ("hierarchical" if multi_node else "shm")
    # shm asked for across nodes runs hierarchical (shared memory inside each node)
    assert algorithms.choose_allreduce(group, 64 << 20, "shm") == large
    assert multi_node == (os.environ.get("MPITRAIN_LOCAL_SIZE") is not None)


@pytest.fixture(scope="module")
def staged_group():
    """A group whose ranks believe they cannot read each other's memory (seccomp, ptrace)."""
    from mpitrain.ops import cma

    real = cma.probe
    cma.probe = lambda comm: False
    try:
        cfg = config_mod.load()
        topo, comms = topology.build(WORLD.Dup(), cfg.local_size)
        g = Group(comms, topo, cfg)
        g.node()  # probe now, while the probe says no
    finally:
        cma.probe = real
    yield g
    g.close()


def test_without_cross_memory_attach_shm_stages_and_others_fall_back(staged_group):
    g = staged_group
    assert SIZE == 1 or not g.node().cma
    if SIZE > 1:
        assert algorithms.choose_allreduce(g, 64 << 20, "hierarchical") == "ring"
        assert algorithms.choose_allreduce(g, 64 << 20, "shm") == (
            "shm" if g.topology.num_nodes == 1 else "ring")
    for algorithm in ("shm", "hierarchical", "auto"):
        for dtype in ("float32", "bfloat16", "int8", "bool"):
            for op in OPS:
                for n in (0, 7, 1009, 300_007):
                    send = values(RANK, n, dtype, op)
                    recv = np.empty_like(send)
                    pre, post = (1.0, 1.0) if dtype == "bool" else (2.0, 0.5)
                    algorithms.allreduce(g, send, recv, Reduction(dtype, pre, post, op),
                                         overrides=Overrides(algorithm=algorithm))
                    want = reference.reduce([values(r, n, dtype, op) for r in range(SIZE)],
                                            dtype, op, pre, post)
                    what = f"staged {algorithm} {dtype} {op.name} n={n}"
                    check(recv, want, dtype, what)
                    assert same_everywhere(g, recv), what
    counts = [(1 << 20) + r for r in range(SIZE)]
    send = np.full(counts[RANK], RANK + 1, dtype=np.uint8)
    recv = np.zeros(sum(counts), dtype=np.uint8)
    algorithms.allgather(g, send, recv, counts)
    want = np.concatenate([np.full(c, r + 1, dtype=np.uint8) for r, c in enumerate(counts)])
    np.testing.assert_array_equal(recv, want)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32"])
def test_pipelined_hierarchical_equals_the_sum_on_every_rank(group, in_place, dtype):
    """MPITRAIN_HIERARCHICAL_PIPELINE: the steps overlap over chunks (of >= 1 MiB, so sizes
    here give 2 to 4 of them, odd lengths included); the result is the reduction, and the
    same bits everywhere."""
    from mpitrain.ops import hierarchical

    saved = hierarchical.MIN_CHUNK_BYTES
    hierarchical.MIN_CHUNK_BYTES = 1 << 16  # smaller chunks: more of them, quicker to test
    try:
        for n, chunks in ((70_001, 4), (40_000, 2), (33, 8)):
            send = values(RANK, n, dtype, ReduceOp.SUM)
            want = reference.reduce([values(r, n, dtype, ReduceOp.SUM) for r in range(SIZE)],
                                    dtype, ReduceOp.SUM)
            recv = send if in_place else np.empty_like(send)
            levels = hierarchical.Hierarchy(group.node(), group.comms.cross,
                                            group.topology.is_homogeneous,
                                            group.workspace("cross"), pipeline=chunks)
            hierarchical.allreduce(levels, send, recv, Reduction(dtype, op=ReduceOp.SUM))
            check(recv, want, dtype, f"n={n} chunks={chunks}")
            assert same_everywhere(group, recv)
    finally:
        hierarchical.MIN_CHUNK_BYTES = saved


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_hierarchical_half_duplex_and_ring_across_agree_to_the_bit(group, dtype):
    """MPITRAIN_HIERARCHICAL_HALF_DUPLEX: between two nodes of an even rank count (2x2) the
    cross step goes one way at a time by default; with it off, the ring.  Each element is
    the same one combination of the two node sums either way."""
    from mpitrain.ops import hierarchical

    for n in (1009, 300_007):
        inputs = [values(r, n, dtype, ReduceOp.SUM) for r in range(SIZE)]
        want = reference.reduce(inputs, dtype, ReduceOp.SUM, 1.0, 0.5)
        results = []
        for half_duplex in (True, False):
            recv = np.empty_like(inputs[RANK])
            levels = hierarchical.Hierarchy(group.node(), group.comms.cross,
                                            group.topology.is_homogeneous,
                                            group.workspace("cross"), half_duplex=half_duplex)
            hierarchical.allreduce(levels, inputs[RANK], recv,
                                   Reduction(dtype, 1.0, 0.5, ReduceOp.SUM))
            check(recv, want, dtype, f"n={n} half_duplex={half_duplex}")
            assert same_everywhere(group, recv)
            results.append(recv)
        np.testing.assert_array_equal(results[0].view(np.uint8), results[1].view(np.uint8))
