"""Horovod's ``DistributedOptimizer(op=Adasum)``: each rank steps alone, then the steps combine.

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         op=hvd.Adasum)

Adasum weighs two updates by their norms and the angle between them, so it must see each
rank's whole update (after momentum, Adam's moments, weight decay), not the raw gradient.  As
Horovod's ``_DistributedAdasumOptimizer``:

1. in backward, once a parameter's gradient is complete (after ``backward_passes_per_step``
   passes), its hook runs the wrapped optimizer's ``step()`` on that parameter alone, turns the
   parameter into its local update (new value - old value, the old value kept aside) and
   submits an in-place Adasum allreduce of the update, named after the parameter;
2. ``step()`` submits what backward did not (a parameter without a gradient here contributes
   a zero update, which Adasum leaves out, since Adasum(a, 0) = a), waits, and sets every
   parameter to its old value plus the combined update.

Learning rate (Horovod's Adasum guide): do not scale the single-rank learning rate by the
number of ranks as one does with Average; Adasum itself adds orthogonal updates and averages
parallel ones (the guide found 2-2.5x the single-worker rate best in its experiments).  With
``MPITRAIN_ADASUM_HIERARCHICAL=1`` each node first averages its ranks' updates (local
averaging, Horovod's GPU/NCCL form), so scale the rate by ``local_size()``, as the guide says
for that form.  Horovod's examples pick the rate with ``hvd.nccl_built()``, which is False in
mpitrain: they choose the flat form's rule, which is the default here.

``synchronize()`` does nothing (the combination needs the local step, which only ``step()``
completes) and ``skip_synchronize()`` is refused, as in Horovod.  The old values take one
extra copy of the parameters' memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import collectives
from ..compression import Compressor
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, size_of
from .gradient_hooks import GradientHooks, OptimizerUsageError, parameter_names


@dataclass(frozen=True)
class UpdateInFlight:
    """One parameter's local update on its way through Adasum (the reduced tensor is the
    compressed update, written in place), and how to undo its compression."""

    handle: collectives.Handle
    ctx: Any

    def combined(self, compression: type[Compressor]) -> torch.Tensor:
        """Wait for the combination of every rank's update and return it."""
        return compression.decompress(collectives.synchronize(self.handle), self.ctx)


class AdasumOptimizer(GradientHooks):
    """Mixed in before the wrapped optimizer's class (see :func:`wrap`)."""

    def __init__(self, params: Any, named_parameters: Any, compression: type[Compressor],
                 backward_passes_per_step: int, process_set: ProcessSet) -> None:
        super().__init__(params)  # type: ignore[call-arg]  # the wrapped class
        self._names = parameter_names(self.param_groups, named_parameters)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.process_set = process_set
        self._communicates = bool(process_set.included())
        self._requires_update = [p for group in self.param_groups for p in group["params"]
                                 if p.requires_grad]
        self._delay = {p: backward_passes_per_step for p in self._requires_update}
        # A parameter's update in flight, or None while its backward passes are not all done.
        self._handles: dict[torch.Tensor, UpdateInFlight | None] = {}
        self._starts: dict[torch.Tensor, torch.Tensor] = {}
        self._hooks = []
        if self._communicates:
            self._starts = {p: torch.zeros_like(p, requires_grad=False)
                            for p in self._requires_update}
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient)
                           for p in self._requires_update]

    def _reductions_pending(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------------ backward side
    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise OptimizerUsageError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate gradients "
                "locally.")
        self._delay[p] -= 1
        self._handles[p] = self._reduce_update(p) if self._delay[p] == 0 else None

    def _reduce_update(self, p: torch.Tensor) -> UpdateInFlight:
        """Step ``p`` alone with the wrapped optimizer, make it the update, submit its Adasum."""
        start = self._starts[p]
        start.copy_(p.detach())
        saved = [group["params"] for group in self.param_groups]
        for group in self.param_groups:
            group["params"] = [p] if any(q is p for q in group["params"]) else []
        try:
            super().step()
        finally:
            for group, params in zip(self.param_groups, saved):
                group["params"] = params
        # .data: autograd's version counter is left alone, as the wrapped step leaves it.
        p.data.sub_(start)
        compressed, ctx = self._compression.compress(p.data)
        handle = collectives.allreduce_async_(compressed, name=self._names[p], op=ReduceOp.ADASUM,
                                    process_set=self.process_set)
        return UpdateInFlight(handle, ctx)

    # ------------------------------------------------------------------ public API
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Finish every parameter's local step, combine the updates with Adasum, apply them.

        Collective: every rank of the process set must call it.
        """
        if not self._communicates:
            return super().step(closure)
        loss = closure() if closure is not None else None
        for p in self._requires_update:
            if self._handles.get(p) is None:
                self._handles[p] = self._reduce_update(p)
        # Everything is submitted before anything is waited for: ranks may order differently.
        try:
            for p, inflight in self._handles.items():
                assert inflight is not None  # every parameter was submitted just above
                update = inflight.combined(self._compression)
                start = self._starts[p]
                start.add_(update)
                p.data.copy_(start)
        finally:
            self._handles.clear()
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
        return loss

    step.hooked = True  # type: ignore[attr-defined]  # see _DistributedOptimizer.step

    def synchronize(self) -> None:
        """Nothing to do: Adasum combines the local steps, which ``step()`` completes."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Refused, as in Horovod: the Adasum optimizer cannot step without combining."""
        raise OptimizerUsageError("Skipping synchronization is not supported when using "
                                  "Adasum optimizer.")
        yield  # pragma: no cover - makes this a generator


def wrap(optimizer: torch.optim.Optimizer, named_parameters: Any,
         compression: type[Compressor], backward_passes_per_step: int,
         process_set: ProcessSet) -> torch.optim.Optimizer | None:
    """The Adasum delta optimizer around ``optimizer``; None for a set of one rank, where
    Horovod keeps its plain optimizer (there is nothing to combine).

    Raises:
        AdasumLayoutError: the process set is not a power of two of ranks (or of nodes,
            hierarchical): a ``ValueError``, and the ``NotImplementedError`` Horovod raises.
    """
    if size_of(process_set) == 1:
        return None
    collectives.check_adasum_layout(process_set)
    cls = type(optimizer.__class__.__name__, (AdasumOptimizer, optimizer.__class__), {})
    wrapped: torch.optim.Optimizer = cls(optimizer.param_groups, named_parameters, compression,
                                         backward_passes_per_step, process_set)
    wrapped.defaults = optimizer.defaults
    wrapped.state = optimizer.state
    return wrapped


__all__ = ["AdasumOptimizer", "wrap"]
