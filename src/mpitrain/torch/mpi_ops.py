"""Differentiable collectives: Horovod's autograd rules on top of :mod:`mpitrain.collectives`.

A tensor that requires grad goes through a thin ``autograd.Function`` whose backward is the
adjoint collective (Horovod's rules: allreduce <- allreduce with the same op and scaling;
allgather <- averaged allreduce, then this rank's rows; broadcast <- averaged allreduce, zero
off the root; alltoall <- alltoall with the received splits; reducescatter <- allgather, times
the set size for Sum).  Gradients may arrive non-contiguous (after ``.sum()`` they are
expanded views): they are made contiguous first, where Horovod would fail.

numpy arrays and tensors without grad take the plain path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import collectives, runtime
from ..compression import Compression, Compressor
from ..dtypes import ReduceOp
from ..process_sets import ProcessSet, global_process_set, rank_in, size_of


def _differentiable(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _linear_op(op: ReduceOp) -> None:
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise RuntimeError(f"the gradient of allreduce with op={op.name.title()} is not defined; "
                           "only Sum and Average are differentiable")


# ---------------------------------------------------------------------------- allreduce
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                post: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (op, pre, post, process_set)
        return collectives.synchronize(collectives.allreduce_async(tensor, None, name, op, pre, post, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, process_set = ctx.args
        _linear_op(op)
        reduced = collectives.allreduce(grad.contiguous(), op=op, prescale_factor=pre,
                              postscale_factor=post, process_set=process_set)
        return reduced, None, None, None, None, None


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, process_set)
        handle = collectives.grouped_allreduce_async(list(tensors), None, name, op, pre, post, process_set)
        return tuple(collectives.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, process_set = ctx.args
        _linear_op(op)
        reduced = collectives.grouped_allreduce([g.contiguous() for g in grads], op=op,
                                      prescale_factor=pre, postscale_factor=post,
                                      process_set=process_set)
        return (None, None, None, None, None, *reduced)


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` across the process set; differentiable for tensors requiring grad.

    Every rank of the process set must call this, in the same order.  See
    :func:`mpitrain.collectives.allreduce_async` for the arguments.
    """
    if not _differentiable(tensor):
        return collectives.allreduce(tensor, average, name, compression, op, prescale_factor,
                           postscale_factor, process_set)
    reduce_op = collectives.resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, name, reduce_op, prescale_factor, postscale_factor,
                           process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce a list of tensors as one request; differentiable for tensors requiring grad."""
    tensors = collectives.as_list(tensors)
    if not _differentiable(*tensors):
        return collectives.grouped_allreduce(tensors, average, name, compression, op, prescale_factor,
                                   postscale_factor, process_set)
    reduce_op = collectives.resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(name, reduce_op, prescale_factor, postscale_factor,
                                   process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ---------------------------------------------------------------------------- allgather
def _my_rows_slice(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    counts = collectives.allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    offset = int(counts[:rank_in(process_set)].sum())
    return grad.narrow(0, offset, rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.shape = tensor.shape
        ctx.process_set = process_set
        return collectives.synchronize(collectives.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = collectives.allreduce(grad.contiguous(), op=ReduceOp.AVERAGE,
                              process_set=ctx.process_set)
        rows = ctx.shape[0] if len(ctx.shape) else 1
        return _my_rows_slice(reduced, rows, ctx.process_set).reshape(ctx.shape), None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(collectives.synchronize(collectives.grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = collectives.grouped_allreduce([g.contiguous() for g in grads], op=ReduceOp.AVERAGE,
                                      process_set=ctx.process_set)
        out = []
        for g, shape in zip(reduced, ctx.shapes):
            rows = shape[0] if len(shape) else 1
            out.append(_my_rows_slice(g, rows, ctx.process_set).reshape(shape))
        return (None, None, *out)


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's tensor along dim 0; differentiable."""
    if not _differentiable(tensor):
        return collectives.allgather(tensor, name, process_set)
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allgather each tensor of a list as one request; differentiable."""
    tensors = collectives.as_list(tensors)
    if not _differentiable(*tensors):
        return collectives.grouped_allgather(tensors, name, process_set)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# ---------------------------------------------------------------------------- broadcast
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return collectives.synchronize(collectives.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = collectives.allreduce(grad.contiguous(), op=ReduceOp.AVERAGE,
                              process_set=ctx.process_set)
        if runtime.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s tensor on every rank; differentiable."""
    if not _differentiable(tensor):
        return collectives.broadcast(tensor, root_rank, name, process_set)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# ----------------------------------------------------------------------------- alltoall
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: ProcessSet) -> Any:
        output, received = collectives.synchronize(collectives.alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        back, _ = collectives.alltoall(grad.contiguous(), splits=ctx.received,
                             process_set=ctx.process_set)
        return back, None, None, None


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Exchange rows with every rank; differentiable.

    Returns:
        As in Horovod: the received tensor, and also the received splits when ``splits`` was
        given (``(output, received_splits)``).
    """
    if _differentiable(tensor):
        output, received = _Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = collectives.alltoall(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# ------------------------------------------------------------------------ reducescatter
class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, pre: float,
                post: float, process_set: ProcessSet) -> torch.Tensor:
        ctx.op = op
        ctx.process_set = process_set
        return collectives.synchronize(collectives.reducescatter_async(tensor, name, op, process_set, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _linear_op(ctx.op)
        gathered = collectives.allgather(grad.contiguous(), process_set=ctx.process_set)
        if ctx.op == ReduceOp.SUM:
            gathered = gathered * size_of(ctx.process_set)
        return gathered, None, None, None, None, None


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ReduceOp, pre: float, post: float,
                process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.op = op
        ctx.process_set = process_set
        handle = collectives.grouped_reducescatter_async(list(tensors), name, op, process_set, pre, post)
        return tuple(collectives.synchronize(handle))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        _linear_op(ctx.op)
        gathered = collectives.grouped_allgather([g.contiguous() for g in grads],
                                       process_set=ctx.process_set)
        if ctx.op == ReduceOp.SUM:
            gathered = [g * size_of(ctx.process_set) for g in gathered]
        return (None, None, None, None, None, *gathered)


def reducescatter(tensor: Any, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = ReduceOp.AVERAGE,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce across ranks and keep this rank's block of rows; differentiable.

    Parameters in Horovod's order; see :func:`mpitrain.collectives.reducescatter`.
    """
    if not _differentiable(tensor):
        return collectives.reducescatter(tensor, name, compression, op, process_set, prescale_factor,
                               postscale_factor)
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, collectives.resolve_op(op, None), prescale_factor,
                               postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          compression: type[Compressor] = Compression.none,
                          op: Any = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each tensor of a list as one request; differentiable."""
    tensors = collectives.as_list(tensors)
    if not _differentiable(*tensors):
        return collectives.grouped_reducescatter(tensors, name, compression, op, process_set,
                                       prescale_factor, postscale_factor)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, collectives.resolve_op(op, None), prescale_factor,
                                       postscale_factor, process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# ------------------------------------------------------------------------ sparse allreduce
def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = None,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Start summing (or averaging) a sparse COO tensor across the process set.

    Every rank's indices and values are allgathered (two named requests, ``<name>.indices``
    and ``<name>.values``; unnamed ones are numbered in order like any collective), so the
    cost grows with the non-zeros, not with the dense size.  As in Horovod, the result is
    not a handle but a function: call it to wait and get the reduced sparse tensor
    (coalesced: entries at the same index are summed).

    Args:
        tensor: a sparse COO tensor (e.g. an embedding's gradient); the same dense shape on
            every rank, any number of non-zeros.
        name: base name of the two requests.
        op: ``Average`` (the default, as for allreduce) or ``Sum``.
        process_set: the ranks taking part (default: all).

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor.
        ValueError: ``op`` is neither Average nor Sum.

    Warning:
        Collective: every rank of ``process_set`` must call it, in the same order.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"sparse_allreduce_async takes a sparse COO tensor, got "
                        f"{tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor)}")
    reduce_op = collectives.resolve_op(op, None)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, got "
                         f"{reduce_op.name.title()}")
    t = tensor if tensor.is_coalesced() else tensor.coalesce()
    # allgather concatenates along dim 0, so indices travel as (nnz, sparse_dim).
    indices_h = collectives.allgather_async(t.indices().t().contiguous(),
                                  name=None if name is None else f"{name}.indices",
                                  process_set=process_set)
    values_h = collectives.allgather_async(t.values().contiguous(),
                                 name=None if name is None else f"{name}.values",
                                 process_set=process_set)

    def result() -> torch.Tensor:
        values = collectives.synchronize(values_h)
        indices = collectives.synchronize(indices_h)
        if reduce_op == ReduceOp.AVERAGE:
            values = values / size_of(process_set)
        return torch.sparse_coo_tensor(indices.t(), values, t.size(),
                                       check_invariants=False).coalesce()

    return result
