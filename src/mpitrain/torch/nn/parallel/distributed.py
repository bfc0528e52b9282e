"""``mpitrain.torch.nn.parallel.DistributedDataParallel``: torch's DDP, on mpitrain's engine.

Drop-in for ``torch.nn.parallel.DistributedDataParallel`` in scripts that use
:mod:`mpitrain.torch.distributed`: same constructor arguments, ``module``, ``no_sync()``; no
torch process group is needed.  At construction every rank's parameter names, shapes and
dtypes are compared (a mismatch fails on every rank, naming the first differing parameter and
the ranks), then parameters and buffers are broadcast from the first rank of the process set.
Gradients are averaged in buckets that overlap backward (:mod:`.reducer`); buffers are
re-broadcast before each forward that follows a synchronised one, as torch does.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .... import collectives
from ....core import runtime
from ....core.process_sets import ProcessSet, global_process_set, set_id_of
from .reducer import Reducer

# Drop-ins numbered per process set: only a set's members build a drop-in over it, so one
# job-wide count would drift apart between its members and the other ranks, and with it the
# names of every later drop-in's collectives (a deadlock at the next one's construction).
_instances: collections.defaultdict[int, itertools.count[int]] = \
    collections.defaultdict(itertools.count)
_MiB = 1024 * 1024


def _layout_mismatch(layouts: list[list[tuple[str, tuple[int, ...], str]]],
                     ranks: list[int]) -> str | None:
    """Describe the first parameter whose name, shape or dtype differs from the first rank's."""
    base = layouts[0]
    for rank, layout in zip(ranks[1:], layouts[1:]):
        for i, (mine, theirs) in enumerate(itertools.zip_longest(base, layout)):
            if mine == theirs:
                continue
            if mine is None or theirs is None:
                return (f"rank {ranks[0]} has {len(base)} parameters to reduce but rank {rank} "
                        f"has {len(layout)}")
            return (f"parameter {i} differs between ranks: rank {ranks[0]} has '{mine[0]}' of "
                    f"shape {mine[1]} ({mine[2]}), rank {rank} has '{theirs[0]}' of shape "
                    f"{theirs[1]} ({theirs[2]})")
    return None


class DistributedDataParallel(nn.Module):
    """Data-parallel training of ``module`` across the ranks of a process set.

    Args:
        module: the model (its parameters on one device, CPU or a GPU).
        device_ids: torch's argument; None, or ``[the module's device index]`` for a GPU module.
        output_device: accepted for compatibility (outputs stay on the module's device).
        dim: accepted for compatibility (there is no scatter across local devices).
        broadcast_buffers: torch's older switch: False neither syncs buffers at init nor
            before forward passes (default True).
        init_sync: check parameters agree and broadcast them (and buffers) at construction.
        process_group: a registered mpitrain ProcessSet (default: all ranks).
        bucket_cap_mb: bucket size cap in MiB (default 25; the first bucket is capped at 1 MiB).
        find_unused_parameters: search each forward's graph for unused parameters and keep
            their gradients as they were when no rank used them.
        check_reduction: deprecated in torch and ignored, as there.
        gradient_as_bucket_view: leave ``p.grad`` as views into the buckets (no copies).
        static_graph: accepted; the reducer needs no static-graph mode.
        skip_all_reduce_unused_params: torch's performance switch, accepted; results are the
            same without it.
        batched_grad_copy: torch's performance switch, accepted; results are the same without
            it.
        forward_sync_buffers: broadcast buffers from the first rank before each forward that
            follows a synchronised one (buffers are synced at init regardless).

    Warning:
        Construction, every synchronised forward/backward, and buffer broadcasts are collective
        over the process set: every rank must run them in the same order.

    Raises:
        ValueError: parameters differ between ranks, mpitrain is not initialised, or an
            argument mpitrain does not support is set.
        TypeError: ``process_group`` is not a ProcessSet.
    """

    def __init__(self, module: nn.Module, device_ids: list[Any] | None = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool | None = None,
                 init_sync: bool = True, process_group: ProcessSet | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, delay_all_reduce_named_params: Any = None,
                 param_to_hook_all_reduce: Any = None, mixed_precision: Any = None,
                 device_mesh: Any = None, skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: Any = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None) -> None:
        super().__init__()
        del output_device, dim, check_reduction, skip_all_reduce_unused_params, batched_grad_copy
        for name, value in (("delay_all_reduce_named_params", delay_all_reduce_named_params),
                            ("param_to_hook_all_reduce", param_to_hook_all_reduce),
                            ("mixed_precision", mixed_precision), ("device_mesh", device_mesh),
                            ("bucket_cap_mb_list", bucket_cap_mb_list)):
            if value is not None:
                raise ValueError(f"DistributedDataParallel({name}=...) is not supported by "
                                 "mpitrain; leave it None")
        if process_group is None:
            process_group = global_process_set
        if not isinstance(process_group, ProcessSet):
            raise TypeError(f"process_group must be an mpitrain ProcessSet (or None), got "
                            f"{type(process_group).__name__}; torch process groups belong to "
                            "torch.nn.parallel.DistributedDataParallel")
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        # torch 2.13's rule: forward_sync_buffers replaces broadcast_buffers and always syncs
        # buffers at init; the old broadcast_buffers=False also skipped the init sync.
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_buffers = forward_sync_buffers, True
        else:
            effective = True if broadcast_buffers is None else broadcast_buffers
            self.forward_sync_buffers, init_buffers = effective, effective
        runtime.state()  # raises the clear not-initialised error
        self.module = module
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self._sync_buffers_next = True
        set_id = set_id_of(process_group)
        number = next(_instances[set_id])
        self._tag = f"{number}" if set_id == 0 else f"set{set_id}.{number}"
        self._root = process_group.ranks[0] if process_group.ranks else 0
        self._check_devices(device_ids)

        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named: dict[int, tuple[str, nn.Parameter]] = {}
        for name, p in module.named_parameters():
            if name not in ignored and p.requires_grad and id(p) not in named:
                named[id(p)] = (name, p)
        self._params = [p for _, p in named.values()]
        self._synced_buffers = [b for name, b in module.named_buffers() if name not in ignored]
        if init_sync:
            self._verify_layout([(name, tuple(p.shape), str(p.dtype))
                                 for name, p in named.values()])
            initial = [p.detach() for p in self._params]
            self._broadcast(initial + (self._synced_buffers if init_buffers else []), "init")
        self.reducer = Reducer(self._params, {id(p): n for n, p in named.values()},
                               process_group, self._tag, int(bucket_cap_mb * _MiB),
                               find_unused_parameters, gradient_as_bucket_view)

    def _check_devices(self, device_ids: list[Any] | None) -> None:
        devices = {p.device for p in self.module.parameters()}
        if len(devices) > 1:
            raise ValueError(f"DistributedDataParallel needs the module on one device, found "
                             f"{sorted(str(d) for d in devices)}")
        device = devices.pop() if devices else torch.device("cpu")
        if device_ids is None:
            return
        if device.type == "cpu" or len(device_ids) != 1:
            raise ValueError(f"device_ids={device_ids!r}: pass None for a CPU module, or the one "
                             f"device index of a GPU module (module is on {device})")
        wanted = torch.device(device.type, device_ids[0]) if isinstance(device_ids[0], int) \
            else torch.device(device_ids[0])
        if wanted != device:
            raise ValueError(f"device_ids={device_ids!r} but the module is on {device}")

    def _verify_layout(self, layout: list[tuple[str, tuple[int, ...], str]]) -> None:
        """Compare every rank's parameters before anything is broadcast into them."""
        layouts = collectives.allgather_object(layout, name=f"ddp.{self._tag}.layout",
                                               process_set=self.process_group)
        problem = _layout_mismatch(layouts, self.process_group.ranks or list(range(len(layouts))))
        if problem is not None:
            raise ValueError(f"DistributedDataParallel: {problem}; every rank must wrap the same "
                             "model")

    def _broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        handles = []
        for i, t in enumerate(tensors):
            target = t if t.is_contiguous() and t.device.type == "cpu" else t.detach().cpu() \
                .contiguous()
            handles.append((t, target, collectives.broadcast_async_(
                target, self._root, name=f"ddp.{self._tag}.{what}.{i}",
                process_set=self.process_group)))
        for t, target, handle in handles:
            handle.wait()
            if target is not t:
                with torch.no_grad():
                    t.copy_(target)

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for :attr:`forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.reducer.finish_pending()
        if self._sync_buffers_next and self.forward_sync_buffers and self._synced_buffers:
            self._broadcast(self._synced_buffers, "buffers")
        output = self.module(*inputs, **kwargs)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._sync_buffers_next = sync
        if sync:
            self.reducer.prepare_for_backward(output)
        return output

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Reduce gradient buckets with ``hook`` instead of an averaged allreduce.

        ``hook`` is a stateful compressor, ``model.register_comm_hook(None,
        hvd.Compression.powersgd(rank=4, start_iter=10))`` (also ``.topk(...)``,
        ``.onebit()``), or torch's kind, ``hook(state, bucket) -> torch.futures.Future``:
        torch's own ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
        ``powerSGD_hook`` (with its ``PowerSGDState``), ``batched_powerSGD_hook`` and the
        fp16/bf16 wrappers work after ``hvd.init()`` alone: with their process group None
        they reduce over torch's default group, which the first hooked backward creates over
        mpitrain when there is none (collective; a drop-in over a process set must give
        them a torch group of its ranks instead).  Call it once, before the first backward;
        hooked buckets are reduced at the end of backward.

        Raises:
            RuntimeError: a hook was registered already.
            ValueError: with ``find_unused_parameters=True``, or a torch hook without a
                group on a drop-in over a process set smaller than the job.
            TypeError: ``hook`` is neither kind.
        """
        self.reducer.register_comm_hook(state, hook)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: forward/backward passes inside skip the reduction.

        The first synchronised backward after it reduces everything accumulated.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


__all__ = ["DistributedDataParallel"]
