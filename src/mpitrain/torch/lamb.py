"""LAMB: Adam's direction, scaled per tensor by a trust ratio, for very large batches.

torch ships no LAMB, and BERT pretraining at scale is where it is used (You et al., "Large Batch
Optimization for Deep Learning: Training BERT in 76 minutes", ICLR 2020, Algorithm 2)::

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g*g
    m^ = m / (1 - b1^t)              v^ = v / (1 - b2^t)        (bias_correction=True)
    u = m^ / (sqrt(v^) + eps) + weight_decay * w
    r = ||w|| / ||u||  (1 when either norm is 0)
    w = w - lr * r * u

Norms are per tensor (one "layer" is one parameter tensor, as in NVIDIA's BERT recipe), so the
step each tensor takes is ``lr`` times its own size: that is what keeps large-batch training
stable.  Give biases and LayerNorm weights a group with ``weight_decay=0.0``, as BERT does.

Under ``DistributedOptimizer`` the gradients are averaged before ``step()`` and every rank
computes the same update, like any other wrapped optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def _check(value: Any, what: str, low: float, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Lamb {what} must be a number, got {type(value).__name__}")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Lamb {what} must be {bound}, got {value!r}")
    return float(value)


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (LAMB).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: the learning rate (the step of each tensor relative to its norm).
        betas: decay of the first and second moment estimates.
        eps: added to ``sqrt(v^)``; BERT uses 1e-6.
        weight_decay: decoupled weight decay, added to the update before the trust ratio.
        bias_correction: divide the moments by ``1 - beta^t`` (NVIDIA's default).

    Raises:
        ValueError, TypeError: a hyper-parameter out of range, naming it.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True) -> None:
        _check(lr, "lr", 0.0)
        _check(eps, "eps", 0.0)
        _check(weight_decay, "weight_decay", 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Lamb betas must be a pair, got {betas!r}")
        _check(betas[0], "betas[0]", 0.0, 1.0)
        _check(betas[1], "betas[1]", 0.0, 1.0)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bool(bias_correction)}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; return ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("Lamb does not support sparse gradients")
                self._update(p, group, beta1, beta2)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], beta1: float,
                beta2: float) -> None:
        assert p.grad is not None  # step() passes only parameters with a gradient
        state = self.state[p]
        if not state:
            state["step"] = 0
            # Moments in at least float32, whatever the parameter's dtype.
            dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["step"] += 1
        t = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        grad = p.grad.to(exp_avg.dtype)
        weights = p.to(exp_avg.dtype)
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["bias_correction"]:
            m_hat = exp_avg / (1 - beta1 ** t)
            v_hat = exp_avg_sq / (1 - beta2 ** t)
        else:
            m_hat, v_hat = exp_avg, exp_avg_sq
        update = m_hat / (v_hat.sqrt() + group["eps"])
        if group["weight_decay"] != 0:
            update.add_(weights, alpha=group["weight_decay"])
        w_norm = torch.linalg.vector_norm(weights)
        u_norm = torch.linalg.vector_norm(update)
        # A zero norm (a fresh zero-initialised bias, or no update at all): plain Adam step.
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm,
                            torch.ones_like(w_norm))
        p.add_((update * trust).to(p.dtype), alpha=-group["lr"])


__all__ = ["Lamb"]
