"""The mpitrain c10d process group: torch.distributed's collectives on mpitrain's engine.

Each torch call becomes one named engine request (negotiated and fused like any other), and
returns a :class:`~mpitrain.torch.c10d.work.Work` whose future completes when the engine's
handle does.  torch's own rule applies: every rank of the group issues the same collectives in
the same order; requests are named ``c10d.<group>.<kind>.<n>`` from a per-group counter, so
they never collide with Horovod-style calls made beside them.

Results are copied into torch's output tensors (the engine allocates gathered outputs itself);
in-place reductions and broadcasts reduce straight in the caller's tensors.  Point-to-point
messages (send/recv) bypass the engine: they travel on a communicator of their own
(:mod:`.p2p`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ... import collectives
from ...collectives import Handle
from ...core.process_sets import ProcessSet
from .p2p import PointToPoint
from .reduce_ops import Reduction, resolve
from .work import Progress, Work

BACKEND_NAME = "mpitrain"
# Typed as Any: torch's stubs describe the Python-facing overloads of these methods, while a
# backend implements the (tensors, options) forms that c10d calls.
_ProcessGroup: Any = dist.ProcessGroup


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _copy_split(source: torch.Tensor, outputs: Sequence[torch.Tensor], what: str) -> None:
    """Copy consecutive pieces of flat ``source`` into ``outputs`` (sized as they are)."""
    sizes = [o.numel() for o in outputs]
    if sum(sizes) != source.numel():
        raise ValueError(f"{what}: the output tensors hold {sum(sizes)} elements but "
                         f"{source.numel()} arrived; size the outputs as the peers' inputs")
    for out, piece in zip(outputs, torch.split(source, sizes)):
        out.copy_(piece.view(out.shape))


class ProcessGroupMpitrain(_ProcessGroup):
    """A torch.distributed process group whose collectives run on mpitrain.

    Created by ``torch.distributed.init_process_group(backend="mpitrain")`` (and
    ``new_group(..., backend="mpitrain")`` for the whole world); not meant to be built by hand.
    """

    def __init__(self, rank: int, size: int, process_set: ProcessSet, world_ranks: list[int],
                 p2p: PointToPoint, group_name: str) -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._process_set = process_set
        self._world_ranks = world_ranks  # mpitrain rank of each group rank
        self._p2p = p2p
        self._group_name = group_name or "default"
        self._counter = itertools.count()
        self._progress = Progress(self._group_name)

    # -------------------------------------------------------------------- identity
    def getBackendName(self) -> str:  # noqa: N802 - the C++ name torch looks up
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # -------------------------------------------------------------------- plumbing
    def _name(self, kind: str) -> str:
        return f"c10d.{self._group_name}.{kind}.{next(self._counter)}"

    def _work(self, handles: list[Handle], outputs: list[Any],
              finish: Callable[[list[Any]], None] | None = None,
              describe: str = "collective") -> Work:
        """A Work that completes once every handle has, after ``finish(results)``."""

        def finish_all() -> None:
            results = [h.wait() for h in handles]
            if finish is not None:
                finish(results)

        work = Work(outputs, finish_all, describe=describe)
        if not handles:
            self._progress.ready(work)
            return work
        remaining = [len(handles)]
        lock = threading.Lock()

        def on_done(_: Handle) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._progress.ready(work)

        for handle in handles:
            handle.add_done_callback(on_done)
        return work

    def _world_rank(self, group_rank: int, what: str) -> int:
        if not 0 <= group_rank < self._size:
            raise ValueError(f"{what}={group_rank} is not a rank of this group (size "
                             f"{self._size})")
        return self._world_ranks[group_rank]

    def _gather_fold(self, tensors: list[torch.Tensor], reduction: Reduction,
                     kind: str) -> list[Handle]:
        for t in tensors:
            reduction.check(t)
        rows = [_flat(t).view(1, -1) for t in tensors]
        return [collectives.grouped_allgather_async(rows, name=self._name(kind),
                                          process_set=self._process_set)]

    # -------------------------------------------------------------------- allreduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """Reduce each tensor in place across the group (every ReduceOp; AVG on floats)."""
        reduction = resolve(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if reduction.fold is not None:
            handles = self._gather_fold(tensors, reduction, "allreduce")

            def fold_into(results: list[Any]) -> None:
                for t, gathered in zip(tensors, results[0]):
                    t.copy_(reduction.apply_fold(gathered).view(t.shape))

            return self._work(handles, tensors, fold_into, f"allreduce {reduction.name}")
        for t in tensors:
            reduction.check(t)
        handle = collectives.grouped_allreduce_async_(list(tensors), name=self._name("allreduce"),
                                            op=reduction.engine_op,
                                            prescale_factor=reduction.prescale,
                                            process_set=self._process_set)
        return self._work([handle], tensors, describe=f"allreduce {reduction.name}")

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """Reduce a list of tensors as one fused engine request."""
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """Reduce onto ``opts.rootRank``; the other ranks' tensors are left unchanged."""
        root = opts.rootRank if opts is not None else 0
        self._world_rank(root, "root rank")
        if self._rank == root:
            return self.allreduce(tensors, opts)
        scratch = [t.clone() for t in tensors]
        inner = self.allreduce(scratch, opts)
        return self._chain(inner, tensors, "reduce")

    def _chain(self, inner: Work, outputs: list[Any], describe: str) -> Work:
        """A Work for ``outputs`` that completes with ``inner`` (errors included)."""
        def finish() -> None:
            inner.wait()

        work = Work(outputs, finish, describe=describe)
        inner.get_future().add_done_callback(lambda _: self._progress.ready(work))
        return work

    # -------------------------------------------------------------------- broadcast
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        """Overwrite the tensors with the root's (``opts.rootRank``, a group rank)."""
        root = self._world_rank(opts.rootRank if opts is not None else 0, "root rank")
        handles = [collectives.broadcast_async_(t, root, name=self._name("broadcast"),
                                      process_set=self._process_set) for t in tensors]
        return self._work(handles, tensors, describe="broadcast")

    # -------------------------------------------------------------------- allgather
    def _allgather_into(self, inputs: list[torch.Tensor],
                        targets: Iterable[list[torch.Tensor]], outputs: list[Any], kind: str,
                        describe: str) -> Work:
        """One engine allgather of ``inputs``: every rank's copy of inputs[i], in rank order,
        is split between the tensors of targets[i] (none on a rank that keeps nothing)."""
        handle = collectives.grouped_allgather_async([_flat(t) for t in inputs],
                                                     name=self._name(kind),
                                                     process_set=self._process_set)

        def copy(results: list[Any]) -> None:
            for gathered, into in zip(results[0], targets):
                _copy_split(gathered, into, describe)

        return self._work([handle], outputs, copy, describe)

    def allgather(self, output_lists: list[list[torch.Tensor]],
                  input_list: list[torch.Tensor], opts: Any = None) -> Work:
        """output_lists[i][r] <- rank r's input_list[i]."""
        return self._allgather_into(input_list, output_lists, output_lists, "allgather",
                                    "allgather")

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Work:
        """output_lists[r][i] <- rank r's input_list[i], as one engine request."""
        # Read when the results are in: a short output list fails the Work, as other bad
        # outputs do, after this rank submitted its part (its peers are not left waiting).
        targets = ([outs[i] for outs in output_lists] for i in range(len(input_list)))
        return self._allgather_into(input_list, targets, output_lists, "allgather",
                                    "allgather_coalesced")

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """outputs[i] <- every rank's inputs[i], concatenated in rank order."""
        return self._allgather_into(inputs, [[out] for out in outputs], outputs, "allgather",
                                    "allgather_into_tensor")

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> Work:
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
               opts: Any = None) -> Work:
        """The root's output_lists[0][r] <- rank r's input (others pass no outputs)."""
        root = opts.rootRank if opts is not None else 0
        self._world_rank(root, "root rank")
        targets = output_lists if self._rank == root else []
        return self._allgather_into(input_list, targets, output_lists, "gather", "gather")

    # -------------------------------------------------------------------- reduce_scatter
    def _reduce_scatter(self, outputs: list[torch.Tensor], rows: list[torch.Tensor],
                        opts: Any, what: str) -> Work:
        """Reduce each (size, m) tensor of ``rows`` and keep row ``rank`` in outputs[i]."""
        reduction = resolve(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for out, r in zip(outputs, rows):
            if r.shape[0] != self._size or r.shape[1] != out.numel():
                raise ValueError(f"{what}: the input holds {r.numel()} elements, expected "
                                 f"{self._size} x {out.numel()} (group size x output)")
        if reduction.fold is not None:
            handles = self._gather_fold(rows, reduction, "reduce_scatter")

            def fold_into(results: list[Any]) -> None:
                for out, r, gathered in zip(outputs, rows, results[0]):
                    full = reduction.apply_fold(gathered).view(r.shape)
                    out.copy_(full[self._rank].view(out.shape))

            return self._work(handles, outputs, fold_into, what)
        for r in rows:
            reduction.check(r)
        handle = collectives.grouped_reducescatter_async(rows, name=self._name("reduce_scatter"),
                                               op=reduction.engine_op,
                                               prescale_factor=reduction.prescale,
                                               process_set=self._process_set)

        def copy(results: list[Any]) -> None:
            for out, mine in zip(outputs, results[0]):
                out.copy_(mine.view(out.shape))

        return self._work([handle], outputs, copy, what)

    def reduce_scatter(self, outputs: list[torch.Tensor],
                       input_lists: list[list[torch.Tensor]], opts: Any = None) -> Work:
        """outputs[i] <- the reduction over ranks of their input_lists[i][rank]."""
        rows = []
        for out, inputs in zip(outputs, input_lists):
            if len(inputs) != self._size or any(t.numel() != out.numel() for t in inputs):
                raise ValueError(f"reduce_scatter needs {self._size} inputs of "
                                 f"{out.numel()} elements each, got sizes "
                                 f"{[t.numel() for t in inputs]}")
            rows.append(torch.stack([_flat(t) for t in inputs]))
        return self._reduce_scatter(outputs, rows, opts, "reduce_scatter")

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """outputs[i] <- block ``rank`` of the reduction of inputs[i] (size x output)."""
        rows = []
        for out, inp in zip(outputs, inputs):
            if inp.numel() != self._size * out.numel():
                raise ValueError(f"reduce_scatter_tensor: input has {inp.numel()} elements, "
                                 f"expected {self._size} x {out.numel()}")
            rows.append(_flat(inp).view(self._size, -1))
        return self._reduce_scatter(outputs, rows, opts, "reduce_scatter_tensor")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Work:
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -------------------------------------------------------------------- alltoall / scatter
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Work:
        """Rows (dim 0) of ``input`` go to the ranks in order; ``output`` receives theirs."""
        splits = list(input_split_sizes) or None
        source = input if input.is_contiguous() else input.contiguous()
        handle = collectives.alltoall_async(source, splits=splits, name=self._name("alltoall"),
                                  process_set=self._process_set)
        expected = list(output_split_sizes)

        def copy(results: list[Any]) -> None:
            received, received_splits = results[0]
            if expected and [int(s) for s in received_splits] != expected:
                raise ValueError(f"all_to_all_single: received splits "
                                 f"{received_splits.tolist()} but output_split_sizes="
                                 f"{expected}")
            _copy_split(received.reshape(-1), [output], "all_to_all_single")

        return self._work([handle], [output], copy, "alltoall")

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> Work:
        """outputs[r] <- rank r's inputs[rank]."""
        if len(inputs) != self._size or len(outputs) != self._size:
            raise ValueError(f"all_to_all needs {self._size} inputs and outputs, got "
                             f"{len(inputs)} and {len(outputs)}")
        flat = torch.cat([_flat(t) for t in inputs])
        handle = collectives.alltoall_async(flat, splits=[t.numel() for t in inputs],
                                  name=self._name("alltoall"), process_set=self._process_set)

        def copy(results: list[Any]) -> None:
            _copy_split(results[0][0], outputs, "all_to_all")

        return self._work([handle], outputs, copy, "alltoall")

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
                opts: Any = None) -> Work:
        """outputs[0] <- the root's input_lists[0][rank] (one alltoall, only the root sends)."""
        root = opts.rootRank if opts is not None else 0
        self._world_rank(root, "root rank")
        out = outputs[0]
        if self._rank == root:
            pieces = input_lists[0]
            flat = torch.cat([_flat(t) for t in pieces])
            splits = [t.numel() for t in pieces]
        else:
            flat = torch.empty(0, dtype=out.dtype, device=out.device)
            splits = [0] * self._size
        handle = collectives.alltoall_async(flat, splits=splits, name=self._name("scatter"),
                                  process_set=self._process_set)

        def copy(results: list[Any]) -> None:
            _copy_split(results[0][0], [out], "scatter")

        return self._work([handle], outputs, copy, "scatter")

    # -------------------------------------------------------------------- barrier
    def barrier(self, opts: Any = None) -> Work:
        """Complete once every rank of the group has entered the barrier."""
        handle = collectives.barrier_async(self._process_set, name=self._name("barrier"))
        return self._work([handle], [], describe="barrier")

    # -------------------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Work:
        """Send ``tensors[0]`` to group rank ``dst``; completes once the buffer is reusable."""
        self._world_rank(dst, "dst")
        return self._p2p.send(tensors[0], dst, tag, self._progress)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Work:
        """Receive into ``tensors[0]`` from group rank ``src``."""
        self._world_rank(src, "src")
        return self._p2p.recv(tensors[0], src, tag, self._progress)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        """Receive from whichever rank sends first; the Work's source rank says who."""
        return self._p2p.recv(tensors[0], None, tag, self._progress)


__all__ = ["BACKEND_NAME", "ProcessGroupMpitrain"]
