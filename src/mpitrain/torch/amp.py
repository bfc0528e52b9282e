"""Mixed precision with ``DistributedOptimizer``: GradScaler reads gradients only once final.

torch's documented AMP order is::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                  # optional: to clip or inspect gradients
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(optimizer)
    scaler.update()

Under ``DistributedOptimizer`` the gradients are still being averaged when ``unscale_`` runs
(explicitly, or inside ``scaler.step``): it would unscale and test for inf/NaN the *local*
gradients while the engine reduces them, and ranks could disagree about skipping a step.  The
replicas then drift apart without an error.  Horovod asks users to call
``optimizer.synchronize()`` first and to step inside ``optimizer.skip_synchronize()``.

:func:`install` (run when ``mpitrain.torch`` is imported) makes torch's order correct instead:
``GradScaler.unscale_`` first asks a DistributedOptimizer to finish its reductions (a
collective: every rank reaches ``unscale_`` at the same point of the same program), so the
scaler unscales, checks and clips averaged gradients, identical on every rank, and the step
that follows does not reduce again.  Horovod's order keeps working unchanged.  Other
optimizers are not touched.
"""

from __future__ import annotations

from typing import Any

import torch

_FINISH = "_finish_reductions_before_unscale"


def install() -> None:
    """Wrap ``torch.amp.GradScaler.unscale_`` once (idempotent; communicates nothing)."""
    scaler_class = torch.amp.GradScaler
    original = scaler_class.unscale_
    if getattr(original, "_mpitrain", False):
        return

    def unscale_(self: Any, optimizer: torch.optim.Optimizer) -> None:
        # Even a disabled scaler's unscale_ marks the point where the user reads gradients
        # (the same script runs with fp16 on and off, or with bf16).
        finish = getattr(optimizer, _FINISH, None)
        if finish is not None:
            finish()
        original(self, optimizer)

    unscale_.__doc__ = original.__doc__
    unscale_._mpitrain = True  # type: ignore[attr-defined]
    scaler_class.unscale_ = unscale_  # type: ignore[method-assign]


__all__ = ["install"]
