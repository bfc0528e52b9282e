"""The collectives that tests/mpi/test_tensorflow_ops.py runs, with their numpy references.

Each case is one collective of one kind (allreduce, grouped, sparse, allgather, broadcast,
alltoall, reducescatter, ...) as seen by one rank: its inputs, how to build it from tensors,
the result every rank must get, and the gradients.  Imported by that test after it has set
TensorFlow's thread variables, which TensorFlow reads when it is first imported.
"""

from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import mpitrain.tensorflow as htf

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
KINDS = 9


class Case(NamedTuple):
    """One collective: this rank's inputs, how to build it, and what it must give."""

    inputs: list  # numpy arrays
    build: Any  # list of tensors -> list of outputs (tensors, or IndexedSlices made dense)
    want: list  # numpy arrays
    upstream: list | None  # this rank's gradient of each output (None: not differentiable)
    want_grads: list | None  # the gradients of the inputs


def val(r, k, shape, dtype=np.float32):
    """Rank r's input for case k: small multiples of 0.5, so every sum is exact."""
    n = int(np.prod(shape)) if shape else 1
    return ((np.arange(n) % 7) * 0.5 + 3 * r + k % 5).reshape(shape).astype(dtype)


def _blocks(n, p):
    """Rows of each rank in a reducescatter of n rows over p ranks."""
    return [n // p + (1 if r < n % p else 0) for r in range(p)]


def case(kind, k, r=RANK, p=SIZE):
    """The k-th collective of a graph, of the given kind, as seen by rank r of p."""
    variant = k // KINDS
    if kind == 0:  # allreduce: Sum, Average (differentiable) or Max (int32)
        op = (htf.Sum, htf.Average, htf.Max)[variant % 3]
        dtype = np.int32 if op == htf.Max else np.float32
        shape = [2 + k % 3, 3]
        xs = [val(q, k, shape, dtype) for q in range(p)]
        us = [val(q, k + 1, shape) for q in range(p)]
        reduce = {htf.Sum: np.sum, htf.Average: np.mean, htf.Max: np.max}[op]
        want = reduce(np.stack(xs), axis=0).astype(dtype)
        grads = None if op == htf.Max else [reduce(np.stack(us), axis=0)]
        return Case([xs[r]], lambda t: [htf.allreduce(t[0], op=op)], [want],
                    None if grads is None else [us[r]], grads)
    if kind == 1:  # grouped_allreduce, two dtypes, Sum
        shapes, dtypes = ([2], [3, 2]), (np.float64, np.float32)
        xs = [[val(q, k + i, s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
              for q in range(p)]
        us = [[val(q, k + 2 + i, s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
              for q in range(p)]
        return Case(xs[r], lambda t: htf.grouped_allreduce(t, op=htf.Sum),
                    [sum(x[i] for x in xs) for i in range(2)], us[r],
                    [sum(u[i] for u in us) for i in range(2)])
    if kind == 2:  # allgather, rows differing per rank
        dtype = np.float32 if variant % 2 == 0 else np.uint8
        xs = [val(q, k, [1 + (q + k) % 3, 2], dtype) for q in range(p)]
        gathered = np.concatenate(xs)
        if dtype != np.float32:
            return Case([xs[r]], lambda t: [htf.allgather(t[0])], [gathered], None, None)
        us = [val(q, k + 3, gathered.shape) for q in range(p)]
        start = sum(len(x) for x in xs[:r])
        mean = np.mean(np.stack(us), axis=0)
        return Case([xs[r]], lambda t: [htf.allgather(t[0])], [gathered], [us[r]],
                    [mean[start:start + len(xs[r])]])
    if kind == 3:  # grouped_allgather of two float tensors
        xs = [[val(q, k, [1 + q % 2, 2]), val(q, k + 1, [2 + (q + k) % 2], np.float64)]
              for q in range(p)]
        gathered = [np.concatenate([x[i] for x in xs]) for i in range(2)]
        us = [[val(q, k + 4, g.shape, g.dtype) for g in gathered] for q in range(p)]
        grads = []
        for i in range(2):
            start = sum(len(x[i]) for x in xs[:r])
            mean = np.mean(np.stack([u[i] for u in us]), axis=0)
            grads.append(mean[start:start + len(xs[r][i])])
        return Case(xs[r], lambda t: htf.grouped_allgather(t), gathered, us[r], grads)
    if kind == 4:  # broadcast from a root that moves with k
        root = k % p
        dtype = np.float64 if variant % 2 == 0 else np.int32
        xs = [val(q, k, [3, 2], dtype) for q in range(p)]
        build = lambda t: [htf.broadcast(t[0], root_rank=root)]  # noqa: E731
        if dtype != np.float64:
            return Case([xs[r]], build, [xs[root]], None, None)
        us = [val(q, k + 5, [3, 2], dtype) for q in range(p)]
        grad = np.mean(np.stack(us), axis=0) if r == root else np.zeros([3, 2])
        return Case([xs[r]], build, [xs[root]], [us[r]], [grad])
    if kind == 5:  # alltoall with uneven splits, received splits checked too
        splits = [[1 + (q + j + k) % 2 for j in range(p)] for q in range(p)]
        xs = [val(q, k, [sum(splits[q]), 2]) for q in range(p)]

        def block(q, j):  # the rows rank q sends to rank j
            lo = sum(splits[q][:j])
            return xs[q][lo:lo + splits[q][j]]

        received = {m: np.concatenate([block(q, m) for q in range(p)]) for m in range(p)}
        us = {m: val(m, k + 6, received[m].shape) for m in range(p)}

        def upstream_of(q, j):  # the gradient rows rank j holds for what rank q sent it
            lo = sum(splits[s][j] for s in range(q))
            return us[j][lo:lo + splits[q][j]]

        grad = np.concatenate([upstream_of(r, j) for j in range(p)])
        mine = np.asarray(splits[r], np.int32)
        got_splits = np.asarray([splits[q][r] for q in range(p)], np.int32)
        return Case([xs[r]], lambda t: list(htf.alltoall(t[0], splits=mine)),
                    [received[r], got_splits], [us[r], None], [grad])
    if kind == 6:  # reducescatter, uneven rows, Sum or Average
        op = (htf.Sum, htf.Average)[variant % 2]
        n = 2 * p + k % p
        xs = [val(q, k, [n, 2]) for q in range(p)]
        total = np.sum(np.stack(xs), axis=0) / (1 if op == htf.Sum else p)
        rows = _blocks(n, p)
        lo = sum(rows[:r])
        us = [val(q, k + 7, [rows[q], 2]) for q in range(p)]
        grad = np.concatenate(us) * (p if op == htf.Sum else 1)
        return Case([xs[r]], lambda t: [htf.reducescatter(t[0], op=op)],
                    [total[lo:lo + rows[r]]], [us[r]], [grad])
    if kind == 7:  # grouped_reducescatter of two tensors, Sum
        ns = (p + 1 + k % 2, 2 * p)
        xs = [[val(q, k, [ns[0], 2]), val(q, k + 1, [ns[1]], np.float64)] for q in range(p)]
        want, us, grads = [], [[None, None] for _ in range(p)], []
        for i, n in enumerate(ns):
            rows = _blocks(n, p)
            lo = sum(rows[:r])
            want.append(sum(x[i] for x in xs)[lo:lo + rows[r]])
            for q in range(p):
                us[q][i] = val(q, k + 8 + i, [rows[q]] + list(xs[q][i].shape[1:]),
                               xs[q][i].dtype)
            grads.append(np.concatenate([u[i] for u in us]) * p)
        return Case(xs[r], lambda t: htf.grouped_reducescatter(t, op=htf.Sum), want, us[r],
                    grads)
    # kind 8: allreduce of a tf.IndexedSlices (what tf.gradients gives for embeddings)
    rows = [np.asarray([q % 5, (q + k) % 5], np.int64) for q in range(p)]
    vals = [val(q, k, [2, 3]) for q in range(p)]
    dense = np.zeros([5, 3], np.float32)
    for q in range(p):
        np.add.at(dense, rows[q], vals[q])

    def sparse(t):
        slices = tf.IndexedSlices(t[0], tf.constant(rows[r]), tf.constant([5, 3], tf.int64))
        return [tf.convert_to_tensor(htf.allreduce(slices, op=htf.Sum))]

    return Case([vals[r]], sparse, [dense], None, None)


def cases(n):
    """A graph of n collectives of every kind, mixed (n == KINDS: one graph per kind)."""
    return [case(k % KINDS, k) for k in range(n)]
