"""Start-up helpers: make every rank's model and optimizer equal to one rank's (Horovod's).

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Both are collective: every rank of the process set calls them, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from .. import collectives
from ..collectives import allgather_object, broadcast_object
from ..core import runtime
from ..core.process_sets import ProcessSet, global_process_set


def _items(params: Any) -> list[tuple[str | None, Any]]:
    """(name or None, tensor) pairs, in the order every rank will broadcast them."""
    if isinstance(params, torch.nn.Module):
        return [(str(k), v) for k, v in sorted(params.state_dict().items())]
    if isinstance(params, Mapping):
        return [(str(k), v) for k, v in sorted(params.items(), key=lambda kv: str(kv[0]))]
    if isinstance(params, (torch.Tensor, np.ndarray, str, bytes)) or not isinstance(params,
                                                                                 Iterable):
        raise TypeError(f"params must be a state dict, a module, or a list of tensors or of "
                        f"(name, tensor) pairs, got {type(params).__name__}")
    items: list[tuple[str | None, Any]] = []
    for i, item in enumerate(params):
        if isinstance(item, tuple):
            if len(item) != 2 or not isinstance(item[0], str):
                raise TypeError(f"params[{i}] must be a tensor or a (name, tensor) pair, got a "
                                f"tuple of {len(item)} items")
            items.append((item[0], item[1]))
        else:
            items.append((None, item))
    return items


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every tensor of ``params`` with ``root_rank``'s, in place.

    Args:
        params: a state dict (``model.state_dict()``: parameters and buffers), a module, a
            dict name -> tensor, a list of tensors (``model.parameters()``), or a list of
            ``(name, tensor)`` pairs (``model.named_parameters()``).  Dicts go in sorted name
            order, as in Horovod; lists in their order.
        root_rank: the world rank whose values win.
        prefix: prefixes the requests' names (for several broadcasts in flight at once).
        process_set: the ranks taking part (default: all).

    Raises:
        TypeError: ``params`` has another type, or a value is not a tensor or array.

    Warning:
        Collective: every rank of ``process_set`` must call it with the same names and shapes.
    """
    handles = []
    for name, value in _items(params):
        if not isinstance(value, (torch.Tensor, np.ndarray)):
            raise TypeError(f"parameter {name!r} is a {type(value).__name__}, not a tensor")
        request_name = None if name is None else f"{prefix or ''}broadcast_parameters.{name}"
        handles.append(collectives.broadcast_async_(value, root_rank, name=request_name,
                                          process_set=process_set))
    for h in handles:
        collectives.synchronize(h)


def _sparse_parameter_ids(optimizer: torch.optim.Optimizer,
                          model: torch.nn.Module | None) -> set[int]:
    """Parameters whose gradients come out sparse: every one for SparseAdam (it takes nothing
    else), and those of ``model``'s sparse embeddings."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        return {id(p) for group in optimizer.param_groups for p in group["params"]}
    ids: set[int] = set()
    for m in model.modules() if model is not None else ():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
            ids.update(id(p) for p in m.parameters())
    return ids


def _zero_missing_gradients(optimizer: torch.optim.Optimizer,
                            model: torch.nn.Module | None) -> None:
    """Give every trainable parameter that has no gradient a zero one, as Horovod leaves them.

    Horovod initialises a fresh optimizer's state with a step on zero gradients and leaves
    those zeros in ``p.grad``; scripts written for it read ``p.grad`` (or broadcast it) right
    after.  The zeros are kept here, the step is not (see broadcast_optimizer_state).
    """
    sparse = _sparse_parameter_ids(optimizer, model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if id(p) in sparse else zero


def _layout(state: dict[str, Any]) -> list[int]:
    return [len(group["params"]) for group in state["param_groups"]]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's optimizer state and hyper-parameters with ``root_rank``'s.

    The whole ``state_dict`` travels: per-parameter state (momentum buffers, Adam moments,
    step counts) and every param group's scalars (``lr``, ``momentum``, ``betas``, ...);
    parameters with no state (frozen, or no gradient yet) are simply absent from it.  An
    optimizer whose state is still empty (no step taken) leaves every rank with an empty
    state, without taking a step; Horovod instead takes a zero-gradient step, which moves the
    parameters of optimizers with weight decay and counts a step Adam never took.  As after
    Horovod's call, every trainable parameter of such a fresh optimizer that has no gradient
    is given a zero one (sparse for SparseAdam and for ``model``'s sparse embeddings), so
    code that reads ``p.grad`` next finds a tensor, not None.

    Args:
        optimizer: a torch optimizer or a :func:`DistributedOptimizer`.
        root_rank: the world rank whose state wins.
        model: tells which parameters have sparse gradients (as in Horovod), and also
            broadcasts this module's parameters and buffers (the usual pair after creating
            or loading a model on one rank).
        process_set: the ranks taking part (default: all).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer (or ``model`` not a module).
        ValueError: on every rank, when some rank's optimizer has a different number of
            param groups or parameters per group than the root's.

    Warning:
        Collective: every rank of ``process_set`` must call it.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not optimizer.state:
        _zero_missing_gradients(optimizer, model)
    is_root = runtime.rank() == root_rank
    state = broadcast_object(optimizer.state_dict() if is_root else None, root_rank=root_rank,
                             process_set=process_set)
    mine, roots = _layout(optimizer.state_dict()), _layout(state)
    problem = "" if mine == roots else (
        f"rank {runtime.rank()}'s optimizer has parameters per group {mine}, root rank "
        f"{root_rank}'s has {roots}")
    problems = [p for p in allgather_object(problem, process_set=process_set) if p]
    if problems:
        raise ValueError("broadcast_optimizer_state: optimizers differ between ranks: "
                         + "; ".join(problems))
    if not is_root:
        optimizer.load_state_dict(state)
    if model is not None:
        broadcast_parameters(model.state_dict(), root_rank, prefix="broadcast_optimizer_state.",
                             process_set=process_set)


__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]
