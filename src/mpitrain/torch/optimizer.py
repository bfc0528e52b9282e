"""Horovod's DistributedOptimizer: average gradients across ranks while backward still runs.

    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    loss.backward()      # each gradient is submitted the moment it is accumulated
    optimizer.step()     # waits for the reductions, then the wrapped optimizer steps

A post-accumulate-grad hook per parameter submits that gradient as a named, asynchronous,
in-place allreduce (a group's gradients together, with ``groups``); the engine negotiates and
fuses them while the rest of backward runs.  ``step()`` (or ``synchronize()``) submits what is
still missing, waits, and steps.  Names make the matching: a parameter that got no gradient on
some rank is submitted there as zeros at ``synchronize()`` and meets the others' requests, so
no rank hangs.  (As in Horovod, that zero stand-in is dense: a parameter whose gradient is
sparse on other ranks must get a gradient on every rank, or use ``sparse_as_dense``.)  This
module keeps Horovod's step protocol (backward passes per step, ``synchronize()`` and
``skip_synchronize()``, GradScaler, ``abandon_step``); when a final gradient goes is the one
submission path chosen at construction (per tensor, groups, a stateful compressor:
:mod:`.gradient_paths`), and what is submitted, and the views below, are
:mod:`.gradient_submission`'s.

Gradient buckets: on CPU, every dense gradient gets a view, shaped like its parameter, in a
flat bucket that the engine sizes (its fusion threshold) and allocates where the data plane
reduces fastest (:mod:`mpitrain.collectives.buckets`; page-aligned memory that a node's peers
read in place).  The hook moves a gradient autograd has just created into its
view (one copy, where the fusion path would pack into a fusion buffer and unpack after) and
makes ``p.grad`` that view; further backward passes accumulate into it in place.  The engine,
seeing in-place requests lying back to back in one buffer, reduces the span where it lies and
the results need no copying back.  ``zero_grad()`` keeps torch's meaning (``set_to_none=False``
zeroes the views in place).  ``shared_buckets=False`` reduces each ``p.grad`` where autograd put
it (packed into the fusion buffer and unpacked by the engine).

``Compression.fp16``/``bf16`` on CPU use buckets of the wire type instead: each float32/float64
gradient has a 16-bit view there, the hook casts the gradient into it (the one cast the
compressor would make, without allocating), the engine reduces the 16-bit span in place, and
``synchronize()`` casts the average back into ``p.grad``.  So the 16-bit bytes travel exactly
as an in-place 16-bit buffer's would, with no per-step allocation or packing.

Stateful compression (``compression=hvd.Compression.powersgd(...)``, ``.topk(...)``,
``.onebit()``, :mod:`mpitrain.compression.stateful`): those compressors keep error memory
between steps and work on buckets of gradients (one low-rank factor exchange per bucket), cut
in backward's order as torch's DDP cuts them (:mod:`.compressed_buckets`).  A bucket whose
gradients are final begins while backward goes on (PowerSGD sends its P factors then);
``synchronize()`` completes every bucket in order, and the compressor leaves the averages in
place.  Their state is per rank: ``hvd.save_checkpoint(optimizer=...)`` saves every rank's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from .. import collectives
from ..compression import Compression, Compressor
from ..compression.stateful import GradientReducer
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet, global_process_set, set_id_of, size_of
from . import adasum_optimizer
from .compressed_buckets import CompressedBuckets
from .gradient_groups import Groups, check_groups, split_groups
from .gradient_hooks import GradientHooks, OptimizerUsageError, parameter_names, positive_int
from .gradient_paths import (
    CompressedPath,
    GradientPath,
    Group,
    GroupedPath,
    LocalPath,
    PerTensorPath,
)
from .gradient_submission import GradientSubmitter, RequestOptions

NamedParameters = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class _Options:
    """:func:`DistributedOptimizer`'s arguments, checked."""

    compression: type[Compressor] | GradientReducer
    backward_passes_per_step: int
    op: ReduceOp
    gradient_predivide_factor: float
    groups: Groups
    sparse_as_dense: bool
    process_set: ProcessSet
    shared_buckets: bool


class _DistributedOptimizer(GradientHooks):
    """Mixed in before the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params: list[dict[str, Any]], named_parameters: NamedParameters | None,
                 options: _Options) -> None:
        super().__init__(params)  # type: ignore[call-arg]  # the wrapped class
        all_params = [p for group in self.param_groups for p in group["params"]]
        self._names: dict[torch.Tensor, str] = parameter_names(self.param_groups,
                                                               named_parameters)
        # A stateful compressor reduces everything at synchronize(); the stateless path
        # (per-gradient requests from the hooks) then sends nothing itself.
        compression = options.compression
        self.compressor: GradientReducer | None = None
        stateless: type[Compressor] = Compression.none
        if isinstance(compression, GradientReducer):
            self.compressor = compression.bind(options.process_set)
        else:
            stateless = compression
        self.backward_passes_per_step = options.backward_passes_per_step
        self.op = options.op
        self.gradient_predivide_factor = options.gradient_predivide_factor
        self.sparse_as_dense = options.sparse_as_dense
        self.process_set = options.process_set
        # What the requests for the gradients are, and the bucket views they may wait in.
        self._submitter = GradientSubmitter(self._names, RequestOptions(
            stateless, self.op, self.gradient_predivide_factor, self.sparse_as_dense,
            self.process_set))
        self._delay: dict[torch.Tensor, int] = {p: self.backward_passes_per_step
                                                for p in all_params}
        self._round_open = False  # a gradient was hooked since the step last ended
        self._synchronized = False
        self._synchronized_for_scaler = False
        self._should_synchronize = True
        self._hooks: list[RemovableHandle] = []
        set_id_of(self.process_set)  # raises for a set that is not registered
        self._communicates = bool(self.process_set.included()) and size_of(self.process_set) > 1
        # Checked on every rank, reducing or not: a bad group fails alike everywhere.
        groups = (split_groups(options.groups, all_params, self._names)
                  if options.groups is not None else None)
        self._path: GradientPath = LocalPath()
        if self._communicates:
            requires_update = [p for p in all_params if p.requires_grad]
            self._path = self._choose_path(requires_update, groups, options.shared_buckets)
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient)
                           for p in requires_update]

    def _choose_path(self, params: list[torch.Tensor], groups: list[Group] | None,
                     shared_buckets: bool) -> GradientPath:
        """The one submission path of this optimizer (see :mod:`.gradient_paths`)."""
        if self.compressor is not None:
            return CompressedPath(self._submitter, self.compressor, params)
        path: PerTensorPath | GroupedPath
        if groups is not None:
            path = GroupedPath(self._submitter, params, groups)
        else:
            path = PerTensorPath(self._submitter, params)
        if shared_buckets:
            self._submitter.build_views(path.bucket_order)
        return path

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's attribute: each parameter's request name (its ``named_parameters`` name,
        else a positional one); Horovod's own tests and some users' code read it."""
        return self._names

    @property
    def _compressed(self) -> CompressedBuckets | None:
        """A stateful compressor's buckets (None on the other paths): how they were cut."""
        return self._path.compressed if isinstance(self._path, CompressedPath) else None

    def _reductions_pending(self) -> bool:
        return self._round_open

    # ------------------------------------------------------------------ backward side
    def _on_gradient(self, p: torch.Tensor) -> None:
        # A new backward pass: an earlier synchronize() no longer covers these gradients (a
        # GradScaler that found inf/NaN skips step(), which would otherwise reset this).
        self._synchronized = self._synchronized_for_scaler = False
        if self._delay[p] <= 0:
            raise OptimizerUsageError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate gradients "
                "locally.")
        self._submitter.adopt_view(p)
        self._round_open = True  # in flight or accumulating: zero_grad() must wait
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._path.gradient_final(p)

    # ------------------------------------------------------------------ public API
    def synchronize(self) -> None:
        """Submit every gradient not yet submitted, wait for all, write results to ``p.grad``.

        Collective: every rank of the process set must call it (``step()`` does).
        """
        if not self._communicates:
            self._synchronized = True
            return
        self._path.submit_rest()
        try:
            self._path.finish()
            self._submitter.resparsify()
        finally:
            self._end_round()
        self._synchronized = True

    def _end_round(self) -> None:
        """Forget this step's requests; the next backward passes count from the start."""
        self._path.end_round()
        self._round_open = False
        self._submitter.densified.clear()
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def abandon_step(self) -> None:
        """Forget a step that failed halfway (elastic training calls this when it restores a
        commit): requests submitted from a backward pass that a lost rank interrupted are
        dropped, and the next backward pass counts from the start, instead of being taken
        for one pass too many."""
        self._end_round()
        self._path.abandon()
        self._synchronized = self._synchronized_for_scaler = False

    def _finish_reductions_before_unscale(self) -> None:
        """GradScaler is about to read the gradients: make them final first (see torch/amp.py).

        Collective, like ``synchronize()``; nothing to do if the user synchronized already or
        steps inside ``skip_synchronize()``.
        """
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
            self._synchronized_for_scaler = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (call ``synchronize()`` first).

        For gradient clipping: ``synchronize()``, clip, then ``with
        optimizer.skip_synchronize(): optimizer.step()``.
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the averaged gradients (unless skipped), then take the wrapped step."""
        if self._synchronized_for_scaler:
            pass  # GradScaler.unscale_ had the gradients averaged already: no second round
        elif self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        self._synchronized_for_scaler = False
        return super().step(closure)

    # The wrapped class's step already runs torch's step hooks and profiling; marking ours as
    # hooked keeps Optimizer.__init__ from wrapping it a second time (hooks would run twice).
    step.hooked = True  # type: ignore[attr-defined]

    def remove_hooks(self) -> None:
        """Stop reducing from backward (the optimizer then steps on local gradients)."""
        super().remove_hooks()
        self._communicates = False


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: NamedParameters | None = None,
                         compression: type[Compressor] | GradientReducer = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = ReduceOp.AVERAGE,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Sequence[Sequence[torch.Tensor]] | int | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         shared_buckets: bool = True) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over the process set.

    The result is an instance of a subclass of ``optimizer``'s class (``isinstance`` still
    holds); it takes over ``optimizer``'s param groups, hyper-parameters and state.

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names the requests (must be unique
            and cover every parameter of the optimizer).  Without it, names are positional.
        compression: ``Compression.none``, ``.fp16`` or ``.bf16``, for the wire; or a
            stateful compressor with error feedback, ``Compression.powersgd(...)``,
            ``.topk(...)`` or ``.onebit()`` (op must be Average; see the module docstring).
        backward_passes_per_step: backward passes accumulated locally per reduction.
        op: ``Average`` (default) or ``Sum`` (also Min, Max, Product); ``Adasum`` switches
            to Horovod's delta optimizer (see :mod:`mpitrain.torch.adasum_optimizer`).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it (protects low-precision sums from overflow).
        num_groups: deprecated spelling of ``groups=<int>``.
        groups: an int (split the parameters into that many groups, each reduced as one
            grouped request once all its gradients are ready) or a list of lists of
            parameters (those groups; the rest go one by one).
        sparse_as_dense: reduce sparse gradients densely instead of through allgather.
        process_set: the ranks averaging together (default: all).
        shared_buckets: keep CPU dense gradients as views of flat buckets in the data
            plane's fastest memory, reduced without copies (see the module docstring).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: bad names, groups, op, factor or ``backward_passes_per_step``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, (_DistributedOptimizer, adasum_optimizer.AdasumOptimizer)):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the plain "
                         "optimizer once")
    stateful = isinstance(compression, GradientReducer)
    if not (stateful or (isinstance(compression, type) and issubclass(compression, Compressor))):
        raise TypeError(f"compression must be Compression.none, .fp16, .bf16, or a stateful "
                        f"compressor such as Compression.powersgd(rank=4), got {compression!r}")
    reduce_op = collectives.resolve_op(op, None)
    if stateful and reduce_op != ReduceOp.AVERAGE:
        raise ValueError(f"{compression!r} averages gradients; it needs op=Average, got "
                         f"op={reduce_op.name.title()}")
    passes = positive_int(backward_passes_per_step, "backward_passes_per_step")
    factor = collectives.scale_factor(gradient_predivide_factor, "gradient_predivide_factor")
    if factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if factor != 1.0 and reduce_op != ReduceOp.AVERAGE:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} is only "
                         f"supported with op=Average, got op={reduce_op.name.title()}")
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups=<int> instead",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    checked_groups = check_groups(groups)
    if reduce_op == ReduceOp.ADASUM:
        # Horovod: plain reduction at size 1, the delta optimizer otherwise (groups and
        # sparse_as_dense do not apply to it).
        assert not isinstance(compression, GradientReducer)  # those need op=Average, above
        adasum = adasum_optimizer.wrap(optimizer, named_parameters, compression, passes,
                                       process_set)
        if adasum is not None:
            return adasum
    mixin = _DistributedOptimizer
    cls = type(optimizer.__class__.__name__, (mixin, optimizer.__class__), {})
    options = _Options(compression, passes, reduce_op, factor, checked_groups,
                       bool(sparse_as_dense), process_set, bool(shared_buckets))
    wrapped: torch.optim.Optimizer = cls(optimizer.param_groups, named_parameters, options)
    wrapped.defaults = optimizer.defaults
    wrapped.state = optimizer.state
    return wrapped


__all__ = ["DistributedOptimizer", "OptimizerUsageError"]
