"""The gradient reducer behind mpitrain's DistributedDataParallel.

Gradients live in flat buckets (:mod:`mpitrain.collectives.buckets`), laid out in reverse
parameter order like torch's DDP, so the buckets fill in roughly the order backward produces
gradients.  A post-accumulate-grad hook moves each gradient into its bucket; the moment a
bucket's last gradient arrives, one in-place averaged allreduce of the whole bucket goes to the
engine, which runs it while backward continues.  A callback queued on the autograd engine runs
at the end of backward: it submits whatever is left, waits, and writes the averaged gradients
back (or leaves ``p.grad`` as a view into the bucket with ``gradient_as_bucket_view``).

Unused parameters never hang a rank: every bucket is submitted on every rank by the end of
backward, a parameter without a gradient contributing zeros.  With
``find_unused_parameters=True`` the forward outputs' autograd graph is searched for parameters
it cannot reach, which are marked ready at once (so their buckets need not wait for the end of
backward), and each bucket also carries one "used here" flag per parameter: after the
reduction a flag of 0 means no rank used the parameter, and its ``p.grad`` is left untouched,
as torch's DDP does.  Without the flag, a parameter that got no gradient is an error (as in
torch), raised after the reduction so the other ranks are not left waiting.

Within ``no_sync()`` hooks only note which parameters received gradients; the next synchronised
backward reduces everything accumulated since.

A communication hook (``register_comm_hook``) replaces the averaged allreduce of each bucket
(:mod:`.comm_hooks` holds both kinds): a stateful compressor of :mod:`mpitrain.compression.stateful`
(PowerSGD, top-k, 1-bit) averages the bucket's gradients itself, or a torch hook
(``hook(state, bucket) -> Future``, torch's own ``allreduce_hook``, ``fp16_compress_hook``,
``powerSGD_hook`` ... among them) gets a GradBucket with torch's methods; torch's hooks whose
group is None reduce over torch's default group, created over mpitrain when none exists
(:mod:`.torch_hooks`).  Buckets begin as they fill, strictly in bucket order, while backward
runs: a compressor's first stage (PowerSGD sends its P factors), or torch's one-collective
hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``), whose allreduce
then overlaps the rest of backward as under torch's reducer.  Any other torch hook runs for
each bucket at the end of backward, each waited for before the next: such a hook may chain
collectives in its futures' callbacks (torch's ``powerSGD_hook`` does), which run on whichever
thread completes the previous one, so two buckets in flight would issue them in different
orders on different ranks.  At the end of backward a compressor's buckets are advanced and
finished, and the hooks' futures waited for, in bucket order.  Either way every rank makes the
hook's collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .... import collectives
from ....collectives import Handle, arrays
from ....collectives.buckets import Bucket, gradient_buckets
from ....core import runtime
from ....core.process_sets import ProcessSet
from .comm_hooks import CastHook, CompressorHook, TorchHook, comm_hook_for


def _tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)


def reachable_parameters(outputs: Any) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``outputs`` accumulates into."""
    stack = [t.grad_fn for t in _tensors_in(outputs) if t.grad_fn is not None]
    seen: set[int] = set()
    found: set[int] = set()
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


class Reducer:
    """Bucketed, overlapped gradient averaging over a process set (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], names: dict[int, str],
                 process_set: ProcessSet, tag: str, bucket_cap_bytes: int,
                 find_unused_parameters: bool, gradient_as_bucket_view: bool) -> None:
        self._names = names
        self._process_set = process_set
        self._tag = tag
        self._find_unused = find_unused_parameters
        self._as_view = gradient_as_bucket_view
        if not process_set.included():
            raise ValueError(f"rank {runtime.rank()} is not a member of {process_set!r}")
        self.buckets = gradient_buckets(list(reversed(params)), process_set, bucket_cap_bytes,
                                        extra_per_param=1 if find_unused_parameters else 0)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        # CUDA buckets go to the GPU data plane as they are when it can run (cupy and a GPU);
        # otherwise, and for other devices, through a host mirror.
        self._host = [None if arrays.reduced_in_place(b.flat) else torch.empty_like(b.flat,
                                                                               device="cpu")
                      for b in self.buckets]
        self._remaining = [len(b.params) for b in self.buckets]
        self._ready: set[int] = set()
        self._handles: dict[int, Handle] = {}
        self._used_since_sync: set[int] = set()
        self._locally_unused: list[str] = []
        self._armed = False  # a synchronised forward ran; its backward must reduce
        self._callback_queued = False
        self.submitted_in_backward = 0  # buckets sent from hooks, before backward ended
        self._comm_hook: CompressorHook | CastHook | TorchHook | None = None
        # With a hook: the complete buckets, and those begun (in bucket order).
        self._hook_ready: set[int] = set()
        self._begun: list[Any] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    # ------------------------------------------------------------------ forward side
    def prepare_for_backward(self, outputs: Any) -> None:
        """Arm the next backward to reduce; with find_unused, mark unreachable params ready."""
        self.finish_pending()
        self._armed = True
        if not self._find_unused:
            return
        reachable = reachable_parameters(outputs)
        for b in self.buckets:
            for p in b.params:
                if id(p) not in reachable:
                    self._mark_ready(p, used=self._accumulated(p))

    def finish_pending(self) -> None:
        """Complete an armed iteration whose backward never ran its end-of-backward step."""
        if self._armed and (self._ready or self._handles):
            self.finalize()
        self._armed = False

    # ------------------------------------------------------------------ backward side
    def _on_gradient(self, p: torch.Tensor) -> None:
        if not self._armed:
            self._used_since_sync.add(id(p))  # no_sync(): reduce it at the next sync
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize)
        self._mark_ready(p, used=True)

    def _accumulated(self, p: torch.Tensor) -> bool:
        return id(p) in self._used_since_sync and p.grad is not None

    def _mark_ready(self, p: torch.Tensor, used: bool) -> None:
        if id(p) in self._ready:
            return
        bucket, i = self._where[id(p)]
        view = bucket.views[i]
        grad = p.grad
        if used and grad is not None:
            if grad.layout != torch.strided:
                raise TypeError(f"parameter '{self._names[id(p)]}' has a sparse gradient; "
                                "mpitrain's DistributedDataParallel reduces dense gradients")
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                if self._as_view:
                    p.grad = view
        else:
            used = False
            view.zero_()
        if self._find_unused:
            bucket.extra[i] = 1 if used else 0
        self._ready.add(id(p))
        self._remaining[bucket.index] -= 1
        if self._remaining[bucket.index] == 0:
            self._submit(bucket)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduce buckets with ``hook`` (see the module docstring); once, before training."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook may only be called once")
        if self._find_unused:
            raise ValueError("communication hooks are not supported with "
                             "find_unused_parameters=True in mpitrain's DistributedDataParallel")
        self._comm_hook = comm_hook_for(state, hook, self._process_set, self._tag)

    def _submit(self, bucket: Bucket) -> None:
        if self._comm_hook is not None:
            if self._comm_hook.begins_in_backward:
                self._hook_ready.add(bucket.index)
                self._begin_hooked()
            return  # otherwise reduced by the hook at the end of backward, in bucket order
        host = self._host[bucket.index]
        target = bucket.flat
        if host is not None:
            host.copy_(bucket.flat)
            target = host
        self._handles[bucket.index] = collectives.allreduce_async_(
            target, name=f"ddp.{self._tag}.bucket.{bucket.index}", op=collectives.Average,
            process_set=self._process_set)

    def finalize(self) -> None:
        """End of backward: send what is left, wait, write the averaged gradients back.

        Raises:
            RuntimeError: without find_unused_parameters, a parameter got no gradient
                (raised after the reduction, which every rank completes).
        """
        self._callback_queued = False
        self._locally_unused = []
        self.submitted_in_backward = len(self._handles) + len(self._begun)
        for b in self.buckets:
            for p in b.params:
                if id(p) not in self._ready:
                    if not self._find_unused and not self._accumulated(p):
                        self._locally_unused.append(self._names[id(p)])
                    self._mark_ready(p, used=self._accumulated(p))
        try:
            for index in sorted(self._handles):
                self._handles[index].wait()
            if self._comm_hook is not None:
                self._comm_hook.finish(self.buckets, self._begun)
        finally:
            self._handles = {}
            self._reset()
        for b in self.buckets:
            host = self._host[b.index]
            if host is not None and self._comm_hook is None:
                b.flat.copy_(host)
            self._write_back(b)
        if self._locally_unused:
            raise RuntimeError(
                f"DistributedDataParallel: parameters {self._locally_unused} received no "
                "gradient in this iteration; pass find_unused_parameters=True if some "
                "parameters are legitimately unused (their reduction completed on every rank)")

    def _begin_hooked(self) -> None:
        """Begin every complete bucket whose turn has come (bucket order, the same calls on
        every rank: the hook's stages submit collectives)."""
        assert self._comm_hook is not None
        while len(self._begun) < len(self.buckets) and len(self._begun) in self._hook_ready:
            bucket = self.buckets[len(self._begun)]
            self._begun.append(self._comm_hook.begin(bucket, len(self.buckets)))

    def _write_back(self, bucket: Bucket) -> None:
        flags = bucket.extra.tolist() if self._find_unused else None
        for i, p in enumerate(bucket.params):
            if flags is not None and flags[i] == 0:
                continue  # no rank used it: leave p.grad as torch's DDP does
            view = bucket.views[i]
            if self._as_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    def _reset(self) -> None:
        self._ready.clear()
        self._hook_ready.clear()
        self._begun = []
        self._used_since_sync.clear()
        self._remaining = [len(b.params) for b in self.buckets]
        self._armed = False

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()


__all__ = ["Reducer", "reachable_parameters"]
