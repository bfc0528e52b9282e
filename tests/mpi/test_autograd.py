"""Horovod's backward rules for the differentiable collectives, with non-contiguous grads."""

import pytest
import torch
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def test_allreduce_backward_is_allreduce(hvd):
    x = torch.full((3, 2), float(RANK + 1), requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    # .sum() hands backward an expanded (stride 0, non-contiguous) gradient.
    (y * (RANK + 1)).sum().backward()
    assert torch.allclose(x.grad, torch.full((3, 2), float(sum(r + 1 for r in range(SIZE)))))


def test_allreduce_average_backward_and_scaling(hvd):
    x = torch.ones(4, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0)
    y.sum().backward()
    # Horovod's rule: the backward is the same allreduce, so the gradient is the Average of
    # prescale * ones over ranks, i.e. 2.
    assert torch.allclose(x.grad, torch.full((4,), 2.0))


def test_grouped_allreduce_backward(hvd):
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, 3, requires_grad=True)
    ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    (ya.sum() + 2 * yb.sum()).backward()
    assert torch.allclose(a.grad, torch.full((2,), float(SIZE)))
    assert torch.allclose(b.grad, torch.full((3, 3), 2.0 * SIZE))


def test_min_max_are_not_differentiable(hvd):
    x = torch.ones(2, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Max)
    with pytest.raises(RuntimeError, match="not defined"):
        y.sum().backward()


def test_allgather_backward_takes_this_ranks_rows(hvd):
    rows = RANK + 1
    x = torch.ones(rows, 2, requires_grad=True)
    y = hvd.allgather(x)
    weights = torch.arange(y.shape[0], dtype=torch.float32).unsqueeze(1).expand(-1, 2)
    (y * weights).sum().backward()
    offset = sum(r + 1 for r in range(RANK))
    expected = torch.arange(offset, offset + rows, dtype=torch.float32).unsqueeze(1).expand(-1, 2)
    assert torch.allclose(x.grad, expected)  # averaged over ranks; identical weights everywhere


def test_grouped_allgather_backward(hvd):
    a = torch.ones(1, requires_grad=True)
    b = torch.ones(2, 2, requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b])
    (ga.sum() + 3 * gb.sum()).backward()
    assert torch.allclose(a.grad, torch.ones(1)) and torch.allclose(b.grad, torch.full((2, 2), 3.0))


def test_broadcast_backward_goes_to_the_root(hvd):
    x = torch.ones(3, requires_grad=True)
    y = hvd.broadcast(x, root_rank=0)
    y.sum().backward()
    expected = 1.0 if RANK == 0 else 0.0
    assert torch.allclose(x.grad, torch.full((3,), expected))


def test_alltoall_backward_returns_rows_home(hvd):
    x = torch.arange(2.0 * SIZE).requires_grad_()
    y, received = hvd.alltoall(x, splits=[2] * SIZE)
    (y * (RANK + 1)).sum().backward()
    # Row block j of x went to rank j, which weighs it by j + 1.
    expected = torch.cat([torch.full((2,), float(j + 1)) for j in range(SIZE)])
    assert torch.allclose(x.grad, expected)
    assert received.tolist() == [2] * SIZE


def test_reducescatter_backward_is_allgather(hvd):
    x = torch.ones(SIZE * 2, 3, requires_grad=True)
    y = hvd.reducescatter(x, op=hvd.Sum)
    (y * (RANK + 1)).sum().backward()
    expected = torch.cat([torch.full((2, 3), float(r + 1) * SIZE) for r in range(SIZE)])
    assert torch.allclose(x.grad, expected)


def test_no_grad_and_numpy_take_the_plain_path(hvd):
    import numpy as np

    with torch.no_grad():
        y = hvd.allreduce(torch.ones(2, requires_grad=True), op=hvd.Sum)
    assert not y.requires_grad
    assert isinstance(hvd.allgather(np.ones((1, 2))), np.ndarray)
