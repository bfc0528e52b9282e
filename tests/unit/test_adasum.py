"""Adasum without MPI: the kernels, and the halving/doubling core over threads, against numpy.

The numpy reference (:func:`mpitrain.ops.reference.adasum`) is the definition: ranks combine
pairwise up a binary tree over rank numbers, each tensor with its own dot product and norms, a
squared norm below sqrt(DBL_MIN) counting as zero.  It rounds every combination to float32 as
the algorithm does, so float32 results must agree to an ulp or two (the dot products are summed
in another order); float64 results to 1e-12.
"""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from mpitrain.ops import adasum, reference
from mpitrain.ops.kernels import adasum as kernels

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dot_and_norms_per_tensor(dtype):
    gen = np.random.default_rng(1)
    a, b = gen.normal(size=50).astype(dtype), gen.normal(size=50).astype(dtype)
    bounds = np.array([0, 7, 7, 31, 50], dtype=np.int64)  # an empty tensor in the middle
    got = kernels.dot_and_norms(a, b, bounds).reshape(-1, 3)
    for t in range(4):
        x = a[bounds[t]:bounds[t + 1]].astype(np.float64)
        y = b[bounds[t]:bounds[t + 1]].astype(np.float64)
        np.testing.assert_allclose(got[t], [x @ y, x @ x, y @ y], rtol=1e-13, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_combine_matches_the_formula(dtype):
    gen = np.random.default_rng(2)
    a, b = gen.normal(size=40).astype(dtype), gen.normal(size=40).astype(dtype)
    b[20:] = 0  # tensor 1 of b is a zero vector: Adasum(a, 0) must be a
    bounds = np.array([0, 20, 40], dtype=np.int64)
    sums = kernels.dot_and_norms(a, b, bounds)
    out = a.copy()
    kernels.combine(out, b, bounds, sums)
    np.testing.assert_array_equal(out[20:], a[20:])
    want = reference.adasum_pair(a[:20], b[:20])
    np.testing.assert_allclose(out[:20], want, rtol=0, atol=4 * np.finfo(dtype).eps)


def test_orthogonal_is_sum_and_parallel_is_average():
    a = np.array([3.0, 0.0, 0.0, 2.0])
    b = np.array([0.0, 5.0, 0.0, 0.0])
    bounds = np.array([0, 4], dtype=np.int64)
    out = a.copy()
    kernels.combine(out, b, bounds, kernels.dot_and_norms(a, b, bounds))
    np.testing.assert_array_equal(out, a + b)
    out = a.copy()
    kernels.combine(out, 3 * a, bounds, kernels.dot_and_norms(a, 3 * a, bounds))
    np.testing.assert_allclose(out, 2 * a, rtol=1e-15)  # (a + 3a) / 2


def test_the_reference_and_the_kernels_share_the_zero_threshold():
    assert reference.ADASUM_TINY_NORM_SQ == kernels.TINY_NORM_SQ


def test_kernels_reject_mixed_types():
    with pytest.raises(TypeError, match="float32 or two float64"):
        kernels.dot_and_norms(np.ones(2, np.float32), np.ones(2), np.array([0, 2]))


# ------------------------------------------------------- the algorithm over threads
class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.mail = {(s, d): queue.Queue() for s in range(size) for d in range(size)}
        self.slots: list[np.ndarray | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)


class ThreadTransport:
    """The Transport protocol among threads: one thread per rank, in lockstep."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size

    def exchange(self, send, recv, peer):
        self.world.mail[(self.rank, peer)].put(send.copy())
        recv[...] = self.world.mail[(peer, self.rank)].get(timeout=30)

    def sum_over_block(self, distance, values):
        w = self.world
        w.slots[self.rank] = values.copy()
        w.barrier.wait()
        block = self.rank // (2 * distance)
        total = sum(w.slots[r] for r in range(w.size) if r // (2 * distance) == block)
        w.barrier.wait()
        values[...] = total


def run_threads(per_rank: list[list[np.ndarray]], dtype: type) -> list[np.ndarray]:
    size = len(per_rank)
    counts = [t.size for t in per_rank[0]]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    world = _World(size)
    bufs = [np.concatenate(ts).astype(dtype) if ts else np.empty(0, dtype) for ts in per_rank]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            tmp = np.empty((bufs[r].size + 1) // 2, dtype=dtype)
            adasum.vhdd(ThreadTransport(world, r), bufs[r], tmp, offsets)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return bufs


def make_inputs(size: int, counts: list[int], seed: int) -> list[list[np.ndarray]]:
    gen = np.random.default_rng(seed)
    return [[gen.normal(size=c) * (1 + r) for c in counts] for r in range(size)]


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vhdd_matches_the_tree(size, dtype):
    counts = [1, 0, 13, 1000, 7, 2]  # odd lengths, an empty tensor: halves cut tensors
    inputs = make_inputs(size, counts, seed=size)
    results = run_threads(inputs, dtype)
    for r in range(1, size):
        np.testing.assert_array_equal(results[r], results[0])  # same bits on every rank
    want = np.concatenate(reference.adasum(inputs, np.dtype(dtype).name))
    scale = max(np.abs(np.concatenate(t)).max() for t in inputs)
    tol = 1e-12 * scale if dtype == np.float64 else 4 * np.finfo(np.float32).eps * scale
    np.testing.assert_allclose(results[0], want, rtol=0, atol=tol)


def test_vhdd_keeps_tensors_apart():
    """Fused or alone, each tensor gets its own coefficients."""
    inputs = make_inputs(4, [300, 5, 64], seed=9)
    fused = run_threads(inputs, np.float64)[0]
    alone = [run_threads([[ts[i]] for ts in inputs], np.float64)[0] for i in range(3)]
    np.testing.assert_allclose(fused, np.concatenate(alone), rtol=1e-13, atol=1e-13)


def test_vhdd_orthogonal_gradients_add_up():
    """Horovod's orthogonality test: orthogonal rank vectors reduce to their sum."""
    q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(37, 8)))
    inputs = [[q[:, r].copy()] for r in range(8)]
    got = run_threads(inputs, np.float64)[0]
    np.testing.assert_allclose(got, q.sum(axis=1), rtol=0, atol=1e-12)


def test_vhdd_zero_contribution_changes_nothing():
    """A joined rank contributes zeros; Adasum(a, 0) = a all the way up the tree."""
    gen = np.random.default_rng(4)
    inputs = [[gen.normal(size=10)], [np.zeros(10)], [np.zeros(10)], [np.zeros(10)]]
    got = run_threads(inputs, np.float64)[0]
    np.testing.assert_array_equal(got, inputs[0][0])


# ------------------------------------------------------------------------- layout checks
def topo(size, node_sizes):
    return SimpleNamespace(size=size, node_sizes=tuple(node_sizes), num_nodes=len(node_sizes),
                           local_size=node_sizes[0], is_homogeneous=len(set(node_sizes)) == 1)


@pytest.mark.parametrize("size", [1, 2, 4, 8, 64])
def test_power_of_two_ranks_pass(size):
    adasum.check_layout(topo(size, [size]), hierarchical=False)


@pytest.mark.parametrize("size", [3, 5, 6, 12])
def test_other_sizes_fail_naming_the_size(size):
    with pytest.raises(ValueError, match=f"power-of-two number of ranks.*has {size}"):
        adasum.check_layout(topo(size, [size]), hierarchical=False)
    with pytest.raises(NotImplementedError):  # what Horovod raises, for its users' except
        adasum.check_layout(topo(size, [size]), hierarchical=False)


def test_hierarchical_needs_equal_nodes_and_power_of_two_nodes():
    adasum.check_layout(topo(6, [3, 3]), hierarchical=True)  # local size need not be 2^k
    with pytest.raises(adasum.AdasumLayoutError, match=r"node sizes are \[2, 1\]"):
        adasum.check_layout(topo(3, [2, 1]), hierarchical=True)
    with pytest.raises(adasum.AdasumLayoutError, match="there are 3"):
        adasum.check_layout(topo(6, [2, 2, 2]), hierarchical=True)
