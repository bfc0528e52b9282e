"""PowerSGD: rank-r gradient approximations, warm-started, with error feedback.

After Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), step for step as torch's ``powerSGD_hook``, so that
the DDP drop-in with this compressor trains as torch's DDP with that hook (to the last bits on
a GPU; on the CPU the two skinny products sum in another order, see :func:`skinny_product`):

1. for the first ``start_iter`` steps, a plain averaged allreduce (the warm-up torch requires:
   early gradients change too fast for a low-rank memory);
2. then each gradient is ``M = grad + error`` (error feedback), viewed as a matrix
   ``(shape[0], -1)``; those where ``(n + m) * r * min_compression_rate < n * m`` are
   compressed, the others (biases, norms, small matrices) are averaged as they are;
3. ``P = M Q`` (Q from the previous step, re-orthogonalised: warm start; random the first
   time, from a seeded generator shared by all ranks), allreduce-sum of every P in one
   request, orthogonalise P, ``Q = Mᵀ P``, allreduce of every Q, divided by the world size,
   and the average is approximated by ``P Qᵀ``;
4. the new error is ``M - P Qᵀ`` on each rank, added to the next step's gradient, so nothing a
   step did not send is lost, only delayed.

The wire carries ``(n + m) * r`` numbers per compressed matrix instead of ``n * m``.

With ``batch_same_shape`` (torch's ``batch_tensors_with_same_shape``) the matrices of one
shape are stacked into one (batch, n, m) tensor, so each of the step's products and
orthogonalisations is one operation per shape instead of one per matrix (a transformer's
layers repeat a few shapes many times); it costs a stacked copy of those gradients per step,
which is why torch, and this class, leave it off by default.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .base import GradientReducer, compressible


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of each matrix of a (batch, n, r) tensor, in place.

    Gram-Schmidt for rank <= 2 and half precision, QR otherwise (torch's choice, so that
    results match its hook bit for bit).
    """
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i:i + 1]
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < rank:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(matrices, out=(matrices, torch.empty(
            matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)))


def skinny_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` for (batch, n, k) ``a`` and a skinny (batch, k, r) ``b`` (r the rank).

    On a CUDA device, torch's ``bmm`` as torch's hook calls it.  On the CPU, torch 2.13's
    ``bmm`` of a large matrix by a few columns is slow: 5 ms for M Q and 23 ms for Mᵀ P at
    2048 x 2048, rank 4, one thread, against 1.5 ms computing the same product as rows,
    ``(bᵀ aᵀ)ᵀ`` (measured 2026-11-29); with two such matrices that was 55 ms of a training
    step's CPU per rank.  The rows' sums run in another order, so the result may differ from
    torch's hook in the last bits (within 1e-6 relative), not in what it approximates.
    """
    if a.device.type != "cpu":
        torch.bmm(a, b, out=out)
        return
    out.copy_(torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).transpose(1, 2))


def flat_span(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view covering ``tensors`` when they lie back to back, in order, in one storage,
    of one dtype (a bucket's gradient views); else None.

    Error feedback's element-wise work (add the error, keep M, subtract the approximation) then
    takes one operation per bucket instead of one per gradient, as torch's hook does on its
    flat bucket: the same numbers, and on a model of hundreds of tensors hundreds of small
    operations (kernel launches on a GPU) fewer per step.
    """
    present = [t for t in tensors if t.numel() > 0]
    if not present:
        return None
    first = present[0]
    storage = first.untyped_storage().data_ptr()
    at = first.data_ptr()
    for t in present:
        if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != at):
            return None
        at += t.numel() * t.element_size()
    return first.as_strided((sum(t.numel() for t in present),), (1,), first.storage_offset())


@dataclass
class _Started:
    """One bucket between :meth:`PowerSGD.begin` and :meth:`PowerSGD.finish`."""

    key: str
    tensors: list[torch.Tensor]
    average: bool
    plain: list[torch.Tensor]  # sent as they are (all of them during the warm-up)
    plain_handle: Any = None
    # Error feedback: the gradients as spans ([one flat view] or the tensors themselves), M
    # kept span by span for the error after decompression, and the spans of the error memory.
    spans: list[torch.Tensor] = field(default_factory=list)
    before: list[torch.Tensor] | None = None
    errors: list[torch.Tensor] = field(default_factory=list)
    compressed: bool = False  # False: a warm-up step
    ordered: list[torch.Tensor] = field(default_factory=list)  # (batch, n, k): the Ms
    # Per entry of ``ordered``: the matrices it stacks, to copy the approximation back into
    # (None where it is a view of a single matrix, written in place).
    stacked_from: list[list[torch.Tensor] | None] = field(default_factory=list)
    ps: list[torch.Tensor] = field(default_factory=list)
    qs: list[torch.Tensor] = field(default_factory=list)
    p_handle: Any = None
    q_handle: Any = None
    advanced: bool = False


@dataclass(eq=False, repr=False)
class PowerSGD(GradientReducer):
    """Low-rank gradient compression (see the module docstring).

    Args:
        rank: the approximation's rank r (torch's ``matrix_approximation_rank``); 1 to 4
            usually suffice, larger is closer to the exact average and sends more.
        start_iter: plain averaged steps before compression starts (torch's
            ``start_powerSGD_iter``; at least 2 with error feedback or warm start).
        min_compression_rate: compress a matrix only when that divides its bytes by more.
        use_error_feedback, warm_start: as in the paper (both on by default).
        orthogonalization_epsilon: added to column norms (guards all-zero columns).
        seed: seeds the random first Q, identical on every rank.
        batch_same_shape: stack same-shaped matrices and compress each stack with one
            batched product and orthogonalisation (torch's
            ``batch_tensors_with_same_shape``; see the module docstring).
    """

    # The settings, in the order (and with the defaults) of Compression.powersgd's arguments.
    # A dataclass without eq, so that two reducers stay distinct (and hashable) as any object.
    rank: int = 1
    start_iter: int = 1000
    min_compression_rate: float = 2
    use_error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0
    batch_same_shape: bool = False

    def __post_init__(self) -> None:
        super().__init__()
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {self.rank!r}")
        if (self.use_error_feedback or self.warm_start) and self.start_iter <= 1:
            raise ValueError(f"PowerSGD start_iter must be > 1 with error feedback or warm start "
                             f"(the first steps fill their memory), got {self.start_iter!r}")
        if self.min_compression_rate <= 0:
            raise ValueError(f"min_compression_rate must be positive, got "
                             f"{self.min_compression_rate!r}")
        self.batch_same_shape = bool(self.batch_same_shape)
        self.rng = np.random.RandomState(self.seed)
        self.iter = 0
        self.errors: dict[str, list[torch.Tensor]] = {}
        self.p_memory: dict[str, torch.Tensor] = {}
        self.q_memory: dict[str, torch.Tensor] = {}
        self._before: dict[str, list[torch.Tensor]] = {}  # scratch of begin() for finish()
        self._error_flat: dict[str, torch.Tensor] = {}  # errors[key]'s views are into this
        self._stacks: dict[str, list[torch.Tensor]] = {}  # batch_same_shape's, reused

    def __repr__(self) -> str:
        batched = ", batch_same_shape=True" if self.batch_same_shape else ""
        return (f"Compression.powersgd(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate}{batched})")

    def _compresses(self, t: torch.Tensor) -> bool:
        if not compressible(t) or t.dim() < 1:
            return False
        n, m = t.shape[0], t.numel() // max(1, t.shape[0])
        r = min(n, m, self.rank)
        return (n + m) * r * self.min_compression_rate < n * m

    def reduce(self, tensors: Sequence[torch.Tensor], key: str = "grads",
               last: bool = True, average: bool = True) -> None:
        self.finish(self.begin(tensors, key, average), last)

    # Stages (see GradientReducer.begin): begin sends P and the plain tensors, advance
    # orthogonalises P and sends Q, finish decompresses and keeps the error.

    def begin(self, tensors: Sequence[torch.Tensor], key: str,
              average: bool = True) -> _Started:
        tensors = list(tensors)
        if self.iter < self.start_iter:
            return _Started(key, tensors, average, plain=tensors,
                            plain_handle=self.allreduce_sum_async(tensors, key, "plain"))
        matrices = [t.view(t.shape[0], -1) for t in tensors if self._compresses(t)]
        plain = [t for t in tensors if not self._compresses(t)]
        started = _Started(key, tensors, average, plain=plain, compressed=True)
        if self.use_error_feedback:
            # M (with last step's error added) is kept in buffers reused from step to step
            # (allocating two tensors per gradient and step cost more than the arithmetic);
            # the errors change only in finish(), so an abandoned step leaves them intact.
            flat = flat_span(tensors)
            started.spans = [flat] if flat is not None else tensors
            started.errors, held = self._error_spans(key, tensors, flat)
            if held:
                for span, e in zip(started.spans, started.errors):
                    span.add_(e)
            before = self._before.get(key)
            if before is None or [b.shape for b in before] != [t.shape for t in started.spans]:
                before = self._before[key] = [torch.empty_like(t) for t in started.spans]
            for span, b in zip(started.spans, before):
                b.copy_(span)
            started.before = before
        if matrices:
            started.ordered, started.stacked_from, started.ps, started.qs = \
                self._factors(matrices, key)
            for m, q, p in zip(started.ordered, started.qs, started.ps):
                skinny_product(m, q, out=p)
            started.p_handle = self.allreduce_sum_async([self.p_memory[key]], key, "P")
        elif key not in self.p_memory:
            # torch's hook draws a seed for a bucket's first compressed step (and keeps empty
            # P and Q memory) even when none of its tensors is compressed: so must we, or every
            # later bucket's first Q comes from another draw than torch's.
            self.p_memory[key] = torch.empty(0)
            self.q_memory[key] = torch.empty(0)
            self.rng.randint(1_000_000_000)
        started.plain_handle = self.allreduce_sum_async(plain, key, "plain")
        return started

    def advance(self, started: _Started) -> None:
        if not started.compressed or started.advanced:
            return
        started.advanced = True
        if not started.ordered:
            return
        self.wait(started.p_handle)
        for p in started.ps:
            orthogonalize(p, self.orthogonalization_epsilon)
        for m, p, q in zip(started.ordered, started.ps, started.qs):
            skinny_product(m.transpose(1, 2), p, out=q)
        started.q_handle = self.allreduce_sum_async([self.q_memory[started.key]],
                                                    started.key, "Q")

    def finish(self, started: _Started, last: bool = True) -> None:
        key, average = started.key, started.average
        if started.compressed:
            self.advance(started)
            if started.ordered:
                self.wait(started.q_handle)
                if average:
                    self.q_memory[key].div_(self.world)
                for p, q, m, group in zip(started.ps, started.qs, started.ordered,
                                          started.stacked_from):
                    torch.bmm(p, q.transpose(1, 2), out=m)
                    for i, original in enumerate(group or ()):
                        original.copy_(m[i])
        self.wait(started.plain_handle)
        if average:
            for t in started.plain:
                t.div_(self.world)
        if started.before is not None:
            # What this rank wanted to contribute minus the approximated average (a sum
            # divided back: the error does not depend on whether the caller sums).
            for b, span, e in zip(started.before, started.spans, started.errors):
                torch.sub(b, span if average else span / self.world, out=e)
        if started.compressed and not self.warm_start:
            self.p_memory.pop(key, None)
            self.q_memory.pop(key, None)
        if last:
            self.iter += 1

    def _error_spans(self, key: str, tensors: list[torch.Tensor],
                     flat: torch.Tensor | None) -> tuple[list[torch.Tensor], bool]:
        """``key``'s error memory, span by span as the gradients ([one buffer] when ``flat``,
        else one per tensor), and whether it holds an earlier step's errors (False the first
        time: nothing to add).  ``errors[key]`` stays one tensor per gradient (checkpoints);
        with ``flat`` those are views of one buffer."""
        errors = self.errors.get(key)
        if flat is None:
            if errors is None:
                errors = self.errors[key] = [torch.zeros_like(t) for t in tensors]
                return errors, False
            return errors, True
        buffer = self._error_flat.get(key)
        if errors is not None and buffer is not None:
            return [buffer], True
        # The first time, or errors restored from a checkpoint: one buffer from now on.
        buffer = (torch.zeros_like(flat) if errors is None
                  else torch.cat([e.reshape(-1) for e in errors]))
        self._error_flat[key] = buffer
        self.errors[key] = [view.view_as(t) for view, t in
                            zip(buffer.split([t.numel() for t in tensors]), tensors)]
        return [buffer], errors is not None

    def _factors(self, matrices: list[torch.Tensor], key: str) -> tuple[
            list[torch.Tensor], list[list[torch.Tensor] | None], list[torch.Tensor],
            list[torch.Tensor]]:
        """The matrices as (batch, n, k) tensors (views of one matrix, or with
        ``batch_same_shape`` stacks of a shape's matrices, with the matrices of each stack),
        and views of their P and Q in this key's memory: Q warm (re-orthogonalised) or, the
        first time, random from the shared generator."""
        dtype, device = matrices[0].dtype, matrices[0].device
        # Same-shaped matrices side by side, in order of first appearance (torch's order,
        # which decides who gets which random numbers). P and Q memory has the same layout
        # batched or not: a stack's factors are its matrices' factors back to back.
        by_shape: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        for m in matrices:
            by_shape[tuple(m.shape)].append(m)
        if self.batch_same_shape:
            ordered, stacked_from = self._stacked(list(by_shape.values()), key)
        else:
            ordered = [m.unsqueeze(0) for group in by_shape.values() for m in group]
            stacked_from = [None] * len(ordered)
        ranks = [min(m.shape[1], m.shape[2], self.rank) for m in ordered]
        p_total = sum(m.shape[0] * m.shape[1] * r for m, r in zip(ordered, ranks))
        q_total = sum(m.shape[0] * m.shape[2] * r for m, r in zip(ordered, ranks))
        fresh = key not in self.p_memory
        if fresh:
            self.p_memory[key] = torch.empty(p_total, device=device, dtype=dtype)
            self.q_memory[key] = torch.empty(q_total, device=device, dtype=dtype)
        ps, qs = [], []
        p_at = q_at = 0
        for m, r in zip(ordered, ranks):
            b, n, k = m.shape
            ps.append(self.p_memory[key][p_at:p_at + b * n * r].view(b, n, r))
            qs.append(self.q_memory[key][q_at:q_at + b * k * r].view(b, k, r))
            p_at += b * n * r
            q_at += b * k * r
        if fresh:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                    orthogonalize(q, self.orthogonalization_epsilon)
        else:
            for q in qs:
                orthogonalize(q, self.orthogonalization_epsilon)
        return ordered, stacked_from, ps, qs

    def _stacked(self, groups: list[list[torch.Tensor]], key: str) -> tuple[
            list[torch.Tensor], list[list[torch.Tensor] | None]]:
        """Each group of same-shaped matrices as one (batch, n, k) tensor: a view of a lone
        matrix, else a stack copied into a buffer kept for ``key`` from step to step."""
        stacked = [g for g in groups if len(g) > 1]
        buffers = self._stacks.get(key)
        if buffers is None or [tuple(b.shape) for b in buffers] != \
                [(len(g), *g[0].shape) for g in stacked]:
            buffers = self._stacks[key] = [
                torch.empty((len(g), *g[0].shape), dtype=g[0].dtype, device=g[0].device)
                for g in stacked]
        ordered: list[torch.Tensor] = []
        stacked_from: list[list[torch.Tensor] | None] = []
        spare = iter(buffers)
        for group in groups:
            if len(group) == 1:
                ordered.append(group[0].unsqueeze(0))
                stacked_from.append(None)
            else:
                ordered.append(torch.stack(group, out=next(spare)))
                stacked_from.append(group)
        return ordered, stacked_from

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"kind": "powersgd", "iter": self.iter, "rng": self.rng.get_state(),
                "errors": {k: [e.clone() for e in v] for k, v in self.errors.items()},
                "p_memory": {k: v.clone() for k, v in self.p_memory.items()},
                "q_memory": {k: v.clone() for k, v in self.q_memory.items()},
                "wire_bytes": self.wire_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "powersgd":
            raise ValueError(f"not a PowerSGD state (kind {state.get('kind')!r})")
        self.iter = int(state["iter"])
        self.rng.set_state(state["rng"])
        self.errors = {k: [e.clone() for e in v] for k, v in state["errors"].items()}
        self._error_flat = {}  # rebuilt from these on the next step
        self.p_memory = {k: v.clone() for k, v in state["p_memory"].items()}
        self.q_memory = {k: v.clone() for k, v in state["q_memory"].items()}
        self.wire_bytes = int(state.get("wire_bytes", 0))
