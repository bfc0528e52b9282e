"""SyncBatchNorm: batch normalisation whose statistics span every rank of a scope.

A drop-in for ``torch.nn.SyncBatchNorm`` and ``BatchNorm1d/2d/3d`` that synchronises over all
ranks (``comm_scope="global"``), over the ranks of this node (``"local"``, as AIACC-Training
offered), or over any process set, on CPU and CUDA tensors alike.

One fused exchange per forward and one per backward, both allreduces through the engine:

* forward: ``[count, sum x, sum x^2]`` per channel, packed into one float64 buffer of 2C+1;
* backward: ``[sum dy, sum dy*(x-mean)]`` per channel, one buffer of 2C.

Why an allreduce of sums rather than torch's allgather of per-rank (mean, invstd, count): the
message stays 2C+1 numbers at any world size (torch's grows as p*(2C+1) and every rank then
combines p rows), ranks with an empty batch contribute exact zeros so no masking is needed, and
the reduction rides the data plane's fastest allreduce.  The classic objection to sum/sum of
squares is cancellation in ``E[x^2] - E[x]^2``; we avoid it where it matters: each rank first
computes its mean and variance with torch's stable ``var_mean``, and the sums are formed and
reduced in float64, so ``Q/N - mean^2`` only loses the spread *between* ranks' means to float64
rounding (relative error ~1e-16 * (mean/std)^2, far below float32 resolution).

Weight and bias gradients stay local, as in torch: the data-parallel gradient reduction (DDP,
DistributedOptimizer) sums them across ranks.  In eval mode, running statistics are used and
nothing is communicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .. import collectives
from ..collectives import arrays
from ..core.process_sets import ProcessSet, size_of
from ..face.scopes import GLOBAL, check_scope, resolve_scope

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reduced-precision inputs are normalised in float32, as torch's CPU kernels do."""
    return torch.float32 if dtype in _HALF else dtype


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Shape a (C,) vector to broadcast over (N, C, *)."""
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _allreduce_sum(buf: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    """Sum ``buf`` over the set in place.

    CUDA statistics go to the GPU data plane as they are when it can run (cupy and a GPU);
    otherwise, as for other devices, one host copy each way (they are a few kilobytes).
    """
    host = buf if arrays.reduced_in_place(buf) else buf.cpu()
    collectives.allreduce_(host, op=collectives.Sum, process_set=process_set)
    if host is not buf:
        buf.copy_(host)
    return buf


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float,
                process_set: ProcessSet) -> torch.Tensor:
        x = x.contiguous()
        channels = x.shape[1]
        count = x.numel() // channels if channels else 0
        compute = _compute_dtype(x.dtype)
        packed = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
        if count > 0:
            var, mean = torch.var_mean(x.to(compute), dim=_channel_dims(x), correction=0)
            mean64, var64 = mean.double(), var.double()
            packed[0] = count
            packed[1:channels + 1] = count * mean64
            packed[channels + 1:] = count * (var64 + mean64 * mean64)
        # A rank with an empty batch still takes part, with zeros (which change no sum):
        # the allreduce is collective, and skipping it would leave every other rank waiting.
        _allreduce_sum(packed, process_set)
        total = float(packed[0])
        if total <= 1:
            # Every rank sees the same total, so every rank raises here together.
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel across the "
                             f"process set when training, got {int(total)} (input size "
                             f"{tuple(x.shape)} on this rank)")
        mean64 = packed[1:channels + 1] / total
        var64 = (packed[channels + 1:] / total - mean64 * mean64).clamp_min_(0.0)
        invstd64 = torch.rsqrt(var64 + eps)
        if running_mean is not None and running_var is not None:
            unbiased = var64 * (total / (total - 1))
            running_mean.mul_(1 - momentum).add_(mean64.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        mean, invstd = mean64.to(compute), invstd64.to(compute)
        scale = invstd if weight is None else invstd * weight.to(compute)
        xc = x.to(compute)
        out = (xc - _per_channel(mean, x)) * _per_channel(scale, x)
        if bias is not None:
            out = out + _per_channel(bias.to(compute), x)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.process_set = process_set
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        compute = mean.dtype
        dims = _channel_dims(x)
        channels = x.shape[1]
        g = grad_out.contiguous().to(compute)
        xmu = x.to(compute) - _per_channel(mean, x)
        sum_dy = g.sum(dim=dims)
        sum_dy_xmu = (g * xmu).sum(dim=dims)

        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            packed = torch.cat([sum_dy, sum_dy_xmu]).double()
            # As in forward: an empty batch still joins the exchange so its peers can finish.
            _allreduce_sum(packed, ctx.process_set)
            mean_dy = (packed[:channels] / ctx.total).to(compute)
            mean_dy_xmu = (packed[channels:] / ctx.total).to(compute)
            w = invstd if weight is None else invstd * weight.to(compute)
            grad_input = (g - _per_channel(mean_dy, x)
                          - xmu * _per_channel(invstd * invstd * mean_dy_xmu, x))
            grad_input = (grad_input * _per_channel(w, x)).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(grad_out.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation over the batch of every rank in a scope.

    Args:
        num_features: C, the channel dimension of inputs shaped (N, C, *).
        eps: added to the variance for numerical stability.
        momentum: running-statistics update factor (None: cumulative average).
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean/variance for eval mode.
        comm_scope: ``"global"``/``1`` (every rank), ``"local"``/``0`` (the ranks of this
            node) or a registered ProcessSet.
        process_set: Horovod's name for the scope (a ProcessSet); overrides ``comm_scope``.

    Warning:
        In training mode forward and backward are collective over the scope: every rank of it
        must run them, in the same order, even with an empty batch.  The first training step
        with ``"local"`` registers the nodes' process sets (collective over all ranks).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 comm_scope: Any = GLOBAL, process_set: ProcessSet | None = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        if process_set is not None:
            if not isinstance(process_set, ProcessSet):
                raise TypeError(f"process_set must be a ProcessSet, got "
                                f"{type(process_set).__name__}")
            comm_scope = process_set
        check_scope(comm_scope)
        self.comm_scope = comm_scope

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2D input (N, C, ...), got "
                             f"{input.dim()}D input of shape {tuple(input.shape)}")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, comm_scope={self.comm_scope!r}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got input with "
                             f"{input.shape[1]} channels (shape {tuple(input.shape)})")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        uses_batch_stats = self.training or (self.running_mean is None
                                             and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats \
            else None
        running_var = self.running_var if not self.training or self.track_running_stats \
            else None
        # Only training synchronises (as torch.nn.SyncBatchNorm): eval mode, and eval without
        # running stats, normalise locally and never communicate.
        if not (self.training and uses_batch_stats):
            return torch.nn.functional.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, uses_batch_stats,
                factor, self.eps)
        process_set = resolve_scope(self.comm_scope)
        if size_of(process_set) == 1:
            return torch.nn.functional.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, True, factor,
                self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor, process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               comm_scope: Any = GLOBAL,
                               process_set: ProcessSet | None = None) -> torch.nn.Module:
        """Return ``module`` with every BatchNorm*D (and torch SyncBatchNorm) replaced.

        Parameters and buffers are shared with (not copied from) the originals, so optimizers
        built before the conversion keep working.

        Args:
            module: the model, or a single batch-norm layer.
            comm_scope: the scope of every converted layer (see :class:`SyncBatchNorm`).
            process_set: Horovod's name for the scope; overrides ``comm_scope``.
        """
        check_scope(comm_scope if process_set is None else process_set)
        output = module
        if isinstance(module, _BatchNorm):
            output = cls(module.num_features, module.eps, module.momentum, module.affine,
                         module.track_running_stats, comm_scope=comm_scope,
                         process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    output.weight = module.weight
                    output.bias = module.bias
            output.running_mean = module.running_mean
            output.running_var = module.running_var
            output.num_batches_tracked = module.num_batches_tracked
            output.training = module.training
            if hasattr(module, "qconfig"):
                output.qconfig = module.qconfig
        for name, child in module.named_children():
            output.add_module(name, cls.convert_sync_batchnorm(child, comm_scope, process_set))
        del module
        return output


__all__ = ["SyncBatchNorm"]
