"""What the hook-driven optimizers (averaging in :mod:`.optimizer`, Adasum in
:mod:`.adasum_optimizer`) share: parameter names, the usage error, and the base class that
owns their per-parameter hooks and counts backward passes."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


class OptimizerUsageError(RuntimeError, AssertionError):
    """The optimizer was driven out of order (Horovod raises AssertionError for these)."""


def positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def parameter_names(param_groups: list[dict[str, Any]],
                    named_parameters: Any) -> dict[torch.Tensor, str]:
    """The request name of every parameter: its name in ``named_parameters``, or positional.

    Raises:
        ValueError: not (name, parameter) tuples, duplicate names, or unnamed parameters.
    """
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually produced by model.named_parameters()")
    else:
        named = [(f"allreduce.noname.{i}.{j}", p)
                 for i, group in enumerate(param_groups)
                 for j, p in enumerate(group["params"])]
    counts = collections.Counter(k for k, _ in named)
    duplicates = sorted(k for k, n in counts.items() if n > 1)
    if duplicates:
        raise ValueError(f"parameter names in named_parameters must be unique; found "
                         f"duplicates: {', '.join(duplicates)}")
    named_ids = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(all_params) if id(p) not in named_ids]
    if unnamed:
        raise ValueError(f"named_parameters was given, but {len(unnamed)} of the "
                         f"optimizer's parameters are not named in it (positions "
                         f"{unnamed[:10]} in the optimizer's parameter list)")
    return {p: k for k, p in sorted(named, key=lambda kv: kv[0])}


class GradientHooks(torch.optim.Optimizer):
    """What the hook-driven optimizers (averaging and Adasum) share: their per-parameter hooks,
    the backward passes they count, and the guard on reductions still pending."""

    _delay: dict[torch.Tensor, int]
    _hooks: list[RemovableHandle]
    backward_passes_per_step: int

    def _reductions_pending(self) -> bool:
        """Whether a backward pass began what ``step()`` or ``synchronize()`` must end."""
        # Each hook-driven optimizer keeps its own record (a mixin of torch's Optimizer cannot
        # be an ABC: the metaclasses differ).
        raise NotImplementedError(f"{type(self).__name__} does not say whether reductions "
                                  "are pending")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch does; an error while reductions are pending.

        Raises:
            OptimizerUsageError: called after ``backward()`` but before ``step()`` or
                ``synchronize()`` (it would race with the reductions in flight).
        """
        if self._reductions_pending():
            raise OptimizerUsageError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                "cause a race condition.")
        super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes locally before each reduction."""
        self.backward_passes_per_step = positive_int(passes, "backward_passes_per_step")
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def remove_hooks(self) -> None:
        """Stop acting from backward."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


__all__ = ["GradientHooks", "OptimizerUsageError", "parameter_names", "positive_int"]
