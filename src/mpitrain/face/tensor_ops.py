"""The Horovod face's tensor collectives, for torch tensors and numpy/cupy arrays alike.

A torch tensor that requires grad (with grad enabled) goes through Horovod's autograd rules in
:mod:`mpitrain.torch.autograd_ops`; everything else takes the plain path of
:mod:`mpitrain.collectives`.  torch is never imported here (a tensor that requires grad means
its caller loaded torch), so ``import mpitrain as hvd`` serves numpy users without torch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from .. import collectives
from ..compression import Compression, Compressor
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set


def _differentiable(*tensors: Any) -> bool:
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and torch.is_grad_enabled()
        and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    )


def _autograd() -> Any:
    """The autograd Functions; only called for a tensor that requires grad (torch is loaded)."""
    from ..torch import autograd_ops  # deferred: the torch face, loaded only for torch tensors

    return autograd_ops


def _reduced_with_grad(tensors: list[Any], name: str | None, compression: type[Compressor],
                       rule: Any) -> list[Any]:
    """``rule``'s reduction (an allreduce or a reducescatter) of ``tensors`` through autograd,
    compressed on the wire (the casts are in the autograd graph too)."""
    pairs = [compression.compress(t) for t in tensors]
    outs = _autograd().GroupedReduction.apply(name, rule, *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` across the process set; differentiable for tensors requiring grad.

    Every rank of the process set must call this, in the same order.  See
    :func:`mpitrain.collectives.allreduce_async` for the arguments.  Through autograd a group
    of one (the same request, the same rule); otherwise straight to the collective, which a
    synchronous call in a loop (a metric, a loss) takes 7-9 us less through than the
    group's lists.
    """
    if not _differentiable(tensor):
        return collectives.allreduce(tensor, average, name, compression, op, prescale_factor,
                                     postscale_factor, process_set)
    return grouped_allreduce([tensor], average, name, compression, op, prescale_factor,
                             postscale_factor, process_set)[0]


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce a list of tensors as one request; differentiable for tensors requiring grad."""
    tensors = collectives.as_list(tensors)
    if not _differentiable(*tensors):
        return collectives.grouped_allreduce(tensors, average, name, compression, op,
                                             prescale_factor, postscale_factor, process_set)
    rule = _autograd().AllreduceRule(collectives.resolve_op(op, average), prescale_factor,
                                     postscale_factor, process_set)
    return _reduced_with_grad(tensors, name, compression, rule)


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's tensor along dim 0; differentiable."""
    if not _differentiable(tensor):
        return collectives.allgather(tensor, name, process_set)
    return _autograd().Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allgather each tensor of a list as one request; differentiable."""
    tensors = collectives.as_list(tensors)
    if not _differentiable(*tensors):
        return collectives.grouped_allgather(tensors, name, process_set)
    return list(_autograd().GroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s tensor on every rank; differentiable."""
    if not _differentiable(tensor):
        return collectives.broadcast(tensor, root_rank, name, process_set)
    return _autograd().Broadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Exchange rows with every rank; differentiable.

    Returns:
        As in Horovod: the received tensor, and also the received splits when ``splits`` was
        given (``(output, received_splits)``).
    """
    if _differentiable(tensor):
        output, received = _autograd().Alltoall.apply(tensor, splits, name, process_set)
    else:
        output, received = collectives.alltoall(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter(tensor: Any, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = ReduceOp.AVERAGE,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce across ranks and keep this rank's block of rows; differentiable.

    Parameters in Horovod's order; see :func:`mpitrain.collectives.reducescatter`.  A group of
    one: the same request, the same autograd rule.
    """
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor,
                                 postscale_factor)[0]


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          compression: type[Compressor] = Compression.none,
                          op: Any = ReduceOp.AVERAGE, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each tensor of a list as one request; differentiable."""
    tensors = collectives.as_list(tensors)
    if not _differentiable(*tensors):
        return collectives.grouped_reducescatter(tensors, name, compression, op, process_set,
                                                 prescale_factor, postscale_factor)
    rule = _autograd().ReducescatterRule(collectives.resolve_op(op, None), prescale_factor,
                                         postscale_factor, process_set)
    return _reduced_with_grad(tensors, name, compression, rule)


__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "reducescatter",
]
