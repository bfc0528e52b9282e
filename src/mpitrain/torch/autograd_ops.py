"""Horovod's autograd rules for the collectives: one ``autograd.Function`` per op, allreduce and
reducescatter sharing one (:class:`GroupedReduction`, its adjoint in its :class:`ReductionRule`).

Each backward is the adjoint collective (allreduce <- allreduce with the same op and scaling;
allgather <- averaged allreduce, then this rank's rows; broadcast <- averaged allreduce, zero
off the root; alltoall <- alltoall with the received splits; reducescatter <- allgather, times
the set size for Sum).  Gradients may arrive non-contiguous (after ``.sum()`` they are
expanded views): they are made contiguous first, where Horovod would fail.

The public functions that choose between these and the plain path are in
:mod:`mpitrain.face.tensor_ops`, which needs no torch; this module is loaded only for tensors that
require grad.  ``sparse_allreduce_async`` (sparse COO tensors) lives here too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import collectives
from ..core import runtime
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set, rank_in, size_of


def _linear_op(op: ReduceOp) -> None:
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise RuntimeError(
            f"the gradient of allreduce with op={op.name.title()} is not defined; "
            "only Sum and Average are differentiable"
        )


@dataclass(frozen=True)
class ReductionRule(ABC):
    """A differentiable reduction: how it starts, and its adjoint, which reduces with the same
    op, scale factors and ranks.  Handed to :class:`GroupedReduction` as one argument."""

    op: ReduceOp
    pre: float
    post: float
    process_set: ProcessSet

    @abstractmethod
    def start(self, tensors: list[torch.Tensor], name: str | None) -> collectives.Handle:
        """Submit the reduction of ``tensors``; the handle's result is the reduced list."""

    @abstractmethod
    def adjoint(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of the inputs, given those of the outputs."""


class AllreduceRule(ReductionRule):
    def start(self, tensors: list[torch.Tensor], name: str | None) -> collectives.Handle:
        return collectives.grouped_allreduce_async(
            tensors, None, name, self.op, self.pre, self.post, self.process_set
        )

    def adjoint(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The same allreduce (Horovod's rule)."""
        return collectives.grouped_allreduce(
            grads,
            op=self.op,
            prescale_factor=self.pre,
            postscale_factor=self.post,
            process_set=self.process_set,
        )


class ReducescatterRule(ReductionRule):
    def start(self, tensors: list[torch.Tensor], name: str | None) -> collectives.Handle:
        return collectives.grouped_reducescatter_async(
            tensors, name, self.op, self.process_set, self.pre, self.post
        )

    def adjoint(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Allgather, times the set size for Sum (the scale factors are not applied again)."""
        gathered = collectives.grouped_allgather(grads, process_set=self.process_set)
        if self.op == ReduceOp.SUM:
            gathered = [g * size_of(self.process_set) for g in gathered]
        return gathered


class GroupedReduction(torch.autograd.Function):
    """An allreduce or a reducescatter of a group of tensors (a group of one for
    ``allreduce`` and ``reducescatter``), as its :class:`ReductionRule` says."""

    @staticmethod
    def forward(
        ctx: Any, name: str | None, rule: ReductionRule, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.rule = rule
        return tuple(collectives.wait_now(rule.start, list(tensors), name))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        _linear_op(ctx.rule.op)
        return (None, None, *ctx.rule.adjoint([g.contiguous() for g in grads]))


def _my_rows_slice(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    counts = collectives.allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    offset = int(counts[: rank_in(process_set)].sum())
    return grad.narrow(0, offset, rows)


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.shape = tensor.shape
        ctx.process_set = process_set
        return collectives.wait_now(collectives.allgather_async, tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = collectives.allreduce(
            grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.process_set
        )
        rows = ctx.shape[0] if len(ctx.shape) else 1
        return _my_rows_slice(reduced, rows, ctx.process_set).reshape(ctx.shape), None, None


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(
            collectives.wait_now(collectives.grouped_allgather_async, list(tensors), name,
                                 process_set)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        reduced = collectives.grouped_allreduce(
            [g.contiguous() for g in grads], op=ReduceOp.AVERAGE, process_set=ctx.process_set
        )
        out = []
        for g, shape in zip(reduced, ctx.shapes):
            rows = shape[0] if len(shape) else 1
            out.append(_my_rows_slice(g, rows, ctx.process_set).reshape(shape))
        return (None, None, *out)


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return collectives.wait_now(
            collectives.broadcast_async, tensor, root_rank, name, process_set
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = collectives.allreduce(
            grad.contiguous(), op=ReduceOp.AVERAGE, process_set=ctx.process_set
        )
        if runtime.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet
    ) -> Any:
        output, received = collectives.wait_now(
            collectives.alltoall_async, tensor, splits, name, process_set
        )
        ctx.received = received
        ctx.process_set = process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        back, _ = collectives.alltoall(
            grad.contiguous(), splits=ctx.received, process_set=ctx.process_set
        )
        return back, None, None, None


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = None,
    process_set: ProcessSet = global_process_set,
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
        raise TypeError(
            f"sparse_allreduce_async takes a sparse COO tensor, got "
            f"{tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor)}"
        )
    reduce_op = collectives.resolve_op(op, None)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(
            f"sparse_allreduce_async supports op=Average or Sum, got {reduce_op.name.title()}"
        )
    t = tensor if tensor.is_coalesced() else tensor.coalesce()
    # allgather concatenates along dim 0, so indices travel as (nnz, sparse_dim).
    indices_h = collectives.allgather_async(
        t.indices().t().contiguous(),
        name=None if name is None else f"{name}.indices",
        process_set=process_set,
    )
    values_h = collectives.allgather_async(
        t.values().contiguous(),
        name=None if name is None else f"{name}.values",
        process_set=process_set,
    )

    def result() -> torch.Tensor:
        values = collectives.synchronize(values_h)
        indices = collectives.synchronize(indices_h)
        if reduce_op == ReduceOp.AVERAGE:
            values = values / size_of(process_set)
        return torch.sparse_coo_tensor(
            indices.t(), values, t.size(), check_invariants=False
        ).coalesce()

    return result
