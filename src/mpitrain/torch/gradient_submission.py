"""How DistributedOptimizer's gradients become requests, and the averages become gradients.

:mod:`.gradient_paths` decides when a gradient goes (its hook, a group complete,
``synchronize()``); this module is what goes and how it comes back, along three paths:

* **one gradient**: a named, asynchronous, in-place allreduce (a sparse gradient through
  allgather instead, unless ``sparse_as_dense``);
* **a group**: one grouped allreduce of its gradients, made dense as in Horovod;
* **a stateful compressor's bucket**: the dense gradients it reduces itself
  (:mod:`.compressed_buckets` asks :meth:`GradientSubmitter.dense_gradients` for them).

A submitted gradient or group is an :class:`InFlight` request (:class:`DenseInFlight`, or
:class:`SparseInFlight` for sparse allgathers); ``finish()`` waits and leaves the result in
``p.grad``.

Where the gradients wait: on CPU, every dense gradient can have a view in a flat bucket the
engine sizes and allocates where the data plane reduces fastest, so that the engine reduces it
in place (:meth:`GradientSubmitter.build_buckets`); with ``Compression.fp16``/``bf16``, every
float32/float64 gradient has a 16-bit view instead, into which the hook casts it and from which
``synchronize()`` casts the average back (:meth:`GradientSubmitter.build_wire_buckets`).  The
optimizer's module docstring says why.  A sparse gradient reduced densely is made sparse again
afterwards, as Horovod does, so that SparseAdam and the like can step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import collectives
from ..collectives import Handle
from ..collectives.buckets import Bucket, gradient_buckets
from ..compression import Compression, Compressor
from ..core.dtypes import ReduceOp
from ..core.process_sets import ProcessSet
from .autograd_ops import sparse_allreduce_async

# The parameters a predicate accepts, in the order their gradients become ready.
BucketOrder = Callable[[Callable[[torch.Tensor], bool]], list[torch.Tensor]]
# The compression context of a gradient reduced in its 16-bit wire view: cast back from it.
_IN_WIRE_VIEW = object()
_WIDE_FLOATS = (torch.float32, torch.float64)


def _lives_in(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``grad`` is (still) the bucket view, not a tensor autograd made anew."""
    return grad.layout == torch.strided and grad.data_ptr() == view.data_ptr()


@dataclass(frozen=True)
class RequestOptions:
    """What every request of one DistributedOptimizer shares.

    ``compression`` is the stateless one (``Compression.none``, ``.fp16``, ``.bf16``): a
    stateful compressor reduces its buckets itself and takes the gradients from
    :meth:`GradientSubmitter.dense_gradients`.
    """

    compression: type[Compressor]
    op: ReduceOp
    gradient_predivide_factor: float
    sparse_as_dense: bool
    process_set: ProcessSet


class InFlight(Protocol):
    """A reduction submitted for one gradient or one group."""

    def finish(self) -> None:
        """Wait for it and leave the result in each gradient (collective completion)."""


WriteBack = Callable[[torch.Tensor, torch.Tensor, object], None]


@dataclass(frozen=True)
class DenseInFlight:
    """An allreduce (grouped for a group) and each gradient's compression context."""

    params: tuple[torch.Tensor, ...]
    handle: Handle
    contexts: tuple[object, ...]
    grouped: bool
    write_back: WriteBack  # GradientSubmitter.write_back

    def finish(self) -> None:
        outputs = collectives.synchronize(self.handle)
        results = outputs if self.grouped else [outputs]
        for p, out, ctx in zip(self.params, results, self.contexts):
            self.write_back(p, out, ctx)


@dataclass(frozen=True)
class SparseInFlight:
    """A sparse gradient's allgathers: ``result`` waits and returns the reduced tensor."""

    param: torch.Tensor
    result: Callable[[], torch.Tensor]

    def finish(self) -> None:
        self.param.grad = self.result()


class GradientSubmitter:
    """One DistributedOptimizer's requests for its gradients (see the module).

    ``names`` is the optimizer's own table of request names (the same dict).
    """

    def __init__(self, names: dict[torch.Tensor, str], options: RequestOptions) -> None:
        self.names = names
        self.compression = options.compression
        self.op = options.op
        self.gradient_predivide_factor = options.gradient_predivide_factor
        self.sparse_as_dense = options.sparse_as_dense
        self.process_set = options.process_set
        self.buckets: list[Bucket] = []
        self.views: dict[torch.Tensor, torch.Tensor] = {}
        self.wire_views: dict[torch.Tensor, torch.Tensor] = {}  # fp16/bf16: see the module
        # Sparse gradients reduced densely (sparse_as_dense, or in a group): made sparse again
        # after the reduction, as Horovod does, so that SparseAdam and the like can step.
        # (parameter -> its gradient's sparse_dim, so rows stay rows for an embedding)
        self.densified: dict[torch.Tensor, int] = {}

    # ------------------------------------------------------------------ set-up
    def build_views(self, bucket_order: BucketOrder) -> None:
        """The bucket views this compression keeps: the gradients' own type (none), the
        16-bit wire type (fp16, bf16), or no views (any other compressor)."""
        if self.compression is Compression.none:
            self.build_buckets(bucket_order)
        elif self.compression.wire_dtype is not None:
            self.build_wire_buckets(bucket_order, getattr(torch, self.compression.wire_dtype))

    def build_buckets(self, bucket_order: BucketOrder) -> None:
        """Give each CPU dense gradient a view in a flat, zeroed bucket the engine allocates."""
        order = bucket_order(lambda p: p.device.type == "cpu")
        # Every bucket at the engine's fusion threshold, the first too: the engine fuses the
        # per-parameter requests of one bucket into one collective anyway.
        self.buckets = gradient_buckets(order, self.process_set, first_cap_bytes=None)
        self.views = {p: b.views[i] for b in self.buckets for i, p in enumerate(b.params)}

    def build_wire_buckets(self, bucket_order: BucketOrder, wire: torch.dtype) -> None:
        """Give each CPU float32/float64 gradient a ``wire``-typed view in a flat bucket."""
        order = bucket_order(lambda p: p.device.type == "cpu" and p.dtype in _WIDE_FLOATS)
        self.buckets = gradient_buckets(order, self.process_set, first_cap_bytes=None,
                                        dtype_of=lambda p: wire)
        self.wire_views = {p: b.views[i] for b in self.buckets
                           for i, p in enumerate(b.params)}

    # ------------------------------------------------------------------ the way there
    def adopt_view(self, p: torch.Tensor) -> None:
        """Move a freshly created dense gradient into its bucket view (first step only)."""
        view = self.views.get(p)
        grad = p.grad
        if view is None or grad is None or grad.layout != torch.strided:
            return
        if not _lives_in(grad, view):
            view.copy_(grad)
            p.grad = view

    def _grad_for_reduce(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            # No gradient here, but another rank may have one: contribute zeros.
            view = self.views.get(p)
            if view is not None:
                view.zero_()
                p.grad = view
            else:
                p.grad = torch.zeros_like(p)
        elif p.grad.layout == torch.strided and not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        return p.grad

    def _scales(self) -> tuple[float, float]:
        if self.op == ReduceOp.AVERAGE:
            # Average = Sum / size; split as (1/f) before and (f/size) after the sum.
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def submit(self, p: torch.Tensor) -> InFlight:
        """Submit ``p``'s gradient alone (zeros if it has none here)."""
        name = self.names[p]
        grad = self._grad_for_reduce(p)
        if grad.is_sparse:
            if not self.sparse_as_dense:
                return SparseInFlight(p, sparse_allreduce_async(grad, name, self.op,
                                                                self.process_set))
            self.densified[p] = grad.sparse_dim()
            grad = p.grad = grad.to_dense()
        compressed, ctx = self._to_wire(p, grad)
        pre, post = self._scales()
        handle = collectives.allreduce_async_(compressed, name=name, op=self.op,
                                              prescale_factor=pre, postscale_factor=post,
                                              process_set=self.process_set)
        return DenseInFlight((p,), handle, (ctx,), False, self.write_back)

    def submit_group(self, group: tuple[torch.Tensor, ...]) -> InFlight:
        """Submit a group's gradients as one grouped request."""
        grads = []
        for p in group:
            g = self._grad_for_reduce(p)
            if g.is_sparse:
                self.densified[p] = g.sparse_dim()
                g = p.grad = g.to_dense()  # grouped allreduce is dense, as in Horovod
            grads.append(g)
        pairs = [self._to_wire(p, g) for p, g in zip(group, grads)]
        pre, post = self._scales()
        handle = collectives.grouped_allreduce_async_([c for c, _ in pairs],
                                            name=f"group.{self.names[group[0]]}",
                                            op=self.op, prescale_factor=pre,
                                            postscale_factor=post, process_set=self.process_set)
        return DenseInFlight(group, handle, tuple(ctx for _, ctx in pairs), True,
                             self.write_back)

    def _to_wire(self, p: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, object]:
        """What travels for ``grad``: its wire view after an in-place cast, or what the
        compressor makes of it; with the context ``write_back`` needs."""
        wire = self.wire_views.get(p)
        if wire is not None and grad.layout == torch.strided:
            wire.copy_(grad)
            return wire, _IN_WIRE_VIEW
        return self.compression.compress(grad)

    def dense_gradients(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """What a compressor reduces for ``params``: each gradient, dense (zeros if none)."""
        grads = []
        for p in params:
            g = self._grad_for_reduce(p)
            if g.is_sparse:
                self.densified[p] = g.sparse_dim()
                g = p.grad = g.to_dense()
            grads.append(g)
        return grads

    # ------------------------------------------------------------------ the way back
    def write_back(self, p: torch.Tensor, output: torch.Tensor, ctx: object) -> None:
        """Leave ``output``, the reduction of ``p``'s gradient, in ``p.grad``."""
        assert p.grad is not None
        if ctx is None and output.data_ptr() == p.grad.data_ptr():
            return  # reduced in place
        if ctx is _IN_WIRE_VIEW:
            p.grad.copy_(output)  # the cast back from the 16-bit average
            return
        p.grad.copy_(self.compression.decompress(output, ctx))

    def resparsify(self) -> None:
        """Sparse gradients reduced densely become sparse again (SparseAdam steps on them)."""
        for p, sparse_dim in self.densified.items():
            assert p.grad is not None
            p.grad = p.grad.to_sparse(sparse_dim)


__all__ = ["BucketOrder", "DenseInFlight", "GradientSubmitter", "InFlight", "RequestOptions",
           "SparseInFlight"]
