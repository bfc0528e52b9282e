"""Horovod behaviours the parity audit (issue 13) found missing or different, each as Horovod's
own scripts and tests use them: sparse_allreduce_async, broadcast_optimizer_state on a fresh
optimizer with frozen parameters, SparseAdam under DistributedOptimizer(sparse_as_dense=True),
alltoall's ValueError for non-integer splits, reducescatter's parameter order, and
broadcast_object/allgather_object carrying functions (Horovod pickles with cloudpickle).

The names and signatures themselves are checked without MPI in tests/unit/test_horovod_parity.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

MPI_CONFIGS = ("np2", "np3")
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
ROWS, COLS = 10, 3


def _sparse_of(rank: int) -> torch.Tensor:
    """A rank's sparse (row-wise, like an embedding's) gradient; any rank can rebuild any."""
    g = torch.Generator().manual_seed(rank)
    rows = torch.randint(0, ROWS, (rank + 2,), generator=g)  # repeats included
    values = torch.randn(rank + 2, COLS, generator=g)
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (ROWS, COLS), check_invariants=True)


# --------------------------------------------------------------------- sparse_allreduce_async
@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("op", ["Sum", "Average", None])
def test_sparse_allreduce_async_equals_the_dense_reduction(hvd, op, named):
    dense = sum(_sparse_of(r).to_dense() for r in range(SIZE))
    if op != "Sum":
        dense = dense / SIZE
    result = hvd.sparse_allreduce_async(_sparse_of(RANK), f"sparse.{op}" if named else None,
                                        None if op is None else getattr(hvd, op))
    assert callable(result)  # Horovod's contract: call it, not synchronize(it)
    out = result()
    assert out.is_sparse
    torch.testing.assert_close(out.to_dense(), dense)


def test_sparse_allreduce_async_rejects_what_it_cannot_reduce(hvd):
    with pytest.raises(ValueError, match="Max"):
        hvd.sparse_allreduce_async(_sparse_of(RANK), "bad.op", hvd.Max)
    with pytest.raises(TypeError, match="sparse"):
        hvd.sparse_allreduce_async(torch.ones(3), "bad.dense", hvd.Sum)
    with pytest.raises(TypeError, match="call it"):
        hvd.synchronize(lambda: None)


# ------------------------------------------------------------------ broadcast_optimizer_state
class _ModelNoGrad(torch.nn.Module):
    """Horovod's test_broadcast_state_no_grad model: one frozen int parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                    requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


def test_broadcast_optimizer_state_of_a_fresh_optimizer_with_frozen_parameters(hvd):
    # Horovod's own test, step for step.
    torch.manual_seed(RANK)
    model = _ModelNoGrad()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                                nesterov=True)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.b.detach().clone()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    grad = optimizer.param_groups[0]["params"][1].grad
    bgrad = hvd.broadcast(grad, root_rank=0)
    assert optimizer.param_groups[0]["params"][0].grad is None
    assert torch.equal(grad, bgrad)
    assert torch.count_nonzero(grad) == 0
    assert torch.equal(model.b.detach(), before)  # no zero step: weight decay moved nothing

    # and training goes on normally from there
    optimizer.zero_grad()
    model(torch.ones(2)).sum().backward()
    optimizer.step()
    everyone = hvd.allgather_object(model.b.detach())
    for other in everyone:
        torch.testing.assert_close(other, everyone[0])


def test_broadcast_optimizer_state_gives_sparse_zeros_to_sparse_adam(hvd):
    emb = torch.nn.Embedding(ROWS, COLS, sparse=True)
    optimizer = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0, model=emb)
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse


# --------------------------------------------------------- SparseAdam with sparse_as_dense
def _embedding_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, ROWS, (SIZE * 2, 3), generator=g),
            torch.randn(SIZE * 2, COLS, generator=g))


@pytest.mark.parametrize("sparse_as_dense", [True, False])
def test_sparse_adam_steps_under_distributed_optimizer(hvd, sparse_as_dense):
    def train(distributed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(ROWS, COLS, sparse=True)
        opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, named_parameters=emb.named_parameters(),
                                           sparse_as_dense=sparse_as_dense)
        for step in range(3):
            idx, y = _embedding_batch(step)
            if distributed:
                idx, y = idx[RANK * 2:(RANK + 1) * 2], y[RANK * 2:(RANK + 1) * 2]
            opt.zero_grad()
            torch.nn.functional.mse_loss(emb(idx).sum(1), y).backward()
            if distributed:
                opt.synchronize()
                assert emb.weight.grad.is_sparse  # back to sparse before SparseAdam steps
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        return emb.weight.detach().clone()

    torch.testing.assert_close(train(True), train(False), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- alltoall
@pytest.mark.parametrize("make", [
    lambda: torch.ones(SIZE, dtype=torch.float32),
    lambda: np.ones(SIZE, dtype=np.float64),
    lambda: [1.0] * SIZE,
], ids=["torch-float", "numpy-float", "list-float"])
def test_alltoall_with_float_splits_raises_value_error(hvd, make):
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.arange(SIZE, dtype=torch.float32), splits=make())
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall_async(torch.arange(SIZE, dtype=torch.float32), splits=make())


# ------------------------------------------------------------------------ reducescatter
def test_reducescatter_takes_horovods_positional_order(hvd):
    x = torch.arange(SIZE * 2, dtype=torch.float32).reshape(SIZE, 2) + RANK
    want = (torch.arange(SIZE * 2, dtype=torch.float32).reshape(SIZE, 2) * SIZE
            + sum(range(SIZE)))[RANK:RANK + 1]
    # (tensor, name, compression, op, process_set, prescale_factor, postscale_factor)
    got = hvd.reducescatter(x, "rs.positional", hvd.Compression.none, hvd.Sum,
                            hvd.global_process_set, 2.0, 0.5)
    torch.testing.assert_close(got, want)
    # (tensor, name, op, process_set, prescale_factor, postscale_factor)
    got = hvd.synchronize(hvd.reducescatter_async(x, "rs.async", hvd.Sum, hvd.global_process_set,
                                                  3.0, 1.0))
    torch.testing.assert_close(got, want * 3)
    outs = hvd.synchronize(hvd.grouped_reducescatter_async([x, x], "rs.grouped", hvd.Sum,
                                                           hvd.global_process_set, 1.0, 2.0))
    for out in outs:
        torch.testing.assert_close(out, want * 2)


def test_reducescatter_with_fp16_compression_keeps_the_dtype(hvd):
    x = torch.full((SIZE, 4), float(RANK + 1))
    got = hvd.reducescatter(x, compression=hvd.Compression.fp16, op=hvd.Sum)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.full((1, 4), float(SIZE * (SIZE + 1) // 2)))
    x.requires_grad_(True)
    outs = hvd.grouped_reducescatter([x], compression=hvd.Compression.fp16, op=hvd.Average)
    outs[0].sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


# ------------------------------------------------------------------------------- objects
def test_broadcast_and_allgather_object_carry_functions_like_horovod(hvd):
    pytest.importorskip("cloudpickle")  # Horovod requires it; mpitrain uses it when present
    offset = RANK * 10
    fn = hvd.broadcast_object(lambda x: x + offset, root_rank=0)
    assert fn(1) == 1  # rank 0's closure, offset 0, on every rank
    fns = hvd.allgather_object(lambda: offset)
    assert [f() for f in fns] == [r * 10 for r in range(SIZE)]


# ----------------------------------------------------------- issue 37: what Horovod raises
@pytest.mark.parametrize("kind", ["shape", "dtype", "root"])
def test_a_mismatch_between_ranks_is_a_runtime_error_as_in_horovod(hvd, kind):
    from mpitrain.core.errors import CollectiveMismatchError

    with pytest.raises(RuntimeError, match="mismatched") as caught:
        if kind == "shape":
            hvd.allreduce(torch.ones(17 + RANK), name="mismatch.shape")
        elif kind == "dtype":
            hvd.allgather(torch.ones(3, dtype=torch.int32 if RANK % 2 else torch.float32),
                          name="mismatch.dtype")
        else:
            hvd.broadcast(torch.ones(3), root_rank=RANK, name="mismatch.root")
    assert isinstance(caught.value, CollectiveMismatchError)
    assert isinstance(caught.value, hvd.HorovodInternalError)
    # Nobody was left waiting: the next collective runs.
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.mismatch").item() == SIZE


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reducescatter_with_adasum_on_integers_is_a_runtime_error(hvd, dtype):
    # Horovod's test_horovod_reducescatter_adasum catches RuntimeError (Horovod refuses Adasum
    # in reducescatter whatever the dtype; mpitrain reduces floats).  On a power-of-two set
    # the error is about the dtype and also a TypeError (a caller's mistake); otherwise about
    # the set's size, a NotImplementedError, which is a RuntimeError too.
    x = torch.ones(SIZE * 4, dtype=dtype)
    with pytest.raises(RuntimeError, match="Adasum"):
        hvd.reducescatter(x, op=hvd.Adasum)
    if SIZE & (SIZE - 1) == 0:
        with pytest.raises(TypeError, match="floating"):
            hvd.reducescatter(x, op=hvd.Adasum)


def test_optimizer_parameter_names_as_horovods(hvd):
    """Horovod's test_optimizer_no_named_parameters: unique names, the same on every rank."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.001))
    names = optimizer._parameter_names
    assert set(names) == set(model.parameters())
    assert len(set(names.values())) == len(names)
    assert hvd.allgather_object(set(names.values())) == [set(names.values())] * SIZE
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.001),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}
