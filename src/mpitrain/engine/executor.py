"""Run the decisions of one round on the data plane: fuse, pack, call ops/, unpack.

Every rank runs the same responses in the same order, so every collective issued here matches
its peers.  A joined rank, which has no tensor for an allreduce, contributes zeros of the
negotiated shape.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import ops
from ..core.dtypes import STORAGE, ReduceOp
from .device import DeviceLayer, is_cuda
from .fusion import Piece, plan
from .negotiation import Response
from .request import Entry, Kind, Request, RequestMeta, average_as_sum
from .timeline import Timeline

_OP_OF = {int(o): o for o in ReduceOp}  # a dict lookup instead of Enum.__call__ per tensor


def _flat(a: np.ndarray) -> np.ndarray:
    return a if a.ndim == 1 else a.reshape(-1)  # (a reshape costs more than the question)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _adjacent_in_place(bucket: list[Piece]) -> np.ndarray | None:
    """A view spanning the bucket when its pieces are in place and back to back in memory.

    The pieces must follow each other in bucket order, which is the same on every rank, so the
    span has exactly the element order a packed fusion buffer would have: a rank that packs
    and a rank that does not still reduce matching elements.
    """
    first = bucket[0].input
    start = _address(first)
    end = start
    for p in bucket:
        if p.input is not p.output and _address(p.input) != _address(p.output):
            return None
        if _address(p.input) != end:
            return None
        end += p.nbytes
    # The pieces keep the memory alive for the duration of the collective.
    raw = np.ctypeslib.as_array(ctypes.cast(start, ctypes.POINTER(ctypes.c_uint8)),
                                shape=(end - start,))
    return raw.view(first.dtype)


def _zeros_entries(meta: RequestMeta) -> list[Entry]:
    """Entries a joined rank uses for an allreduce it never submitted: zeros."""
    entries = []
    for dtype, _ndim, shape in meta.tensors:
        zeros = np.zeros(shape, dtype=STORAGE[dtype])
        entries.append(Entry(input=zeros, shape=tuple(shape), dtype=dtype,
                             output=np.empty_like(zeros)))
    return entries


class Executor:
    """Turns one process set's responses into data-plane calls."""

    def __init__(self, group: ops.Group, timeline: Timeline,
                 fusion_threshold: Callable[[], int]) -> None:
        self.group = group
        self.timeline = timeline
        self._fusion_threshold = fusion_threshold  # the engine's live one (autotune's)
        # Autotune's choices (None: the configuration's); set by the engine at the same cycle
        # on every rank, so every rank still runs the same collectives.
        self.overrides = ops.Overrides()
        self.collectives = 0  # data-plane calls issued, for tests and the overhead benchmark
        self.fused_tensors = 0
        self.zero_copy_buckets = 0  # fused buckets reduced in place without packing
        self.device = DeviceLayer(group)  # CUDA requests; imports nothing until one runs

    @property
    def fusion_threshold(self) -> int:
        """The engine's current fusion threshold, which gradient buckets are planned at too."""
        return self._fusion_threshold()

    def close(self) -> None:
        self.device.close()

    # ------------------------------------------------------------------------ entry point
    def run(self, responses: list[Response]) -> None:
        """Execute the data-carrying responses of a round (errors/control handled by caller)."""
        allreduce: list[tuple[Any, Piece]] = []
        broadcast: list[tuple[Any, Piece]] = []
        others: list[Response] = []
        reductions: dict[Any, ops.Reduction] = {}  # one per fusion key, made once a round
        for resp in responses:
            kind = resp.kind
            if kind == Kind.ALLREDUCE and resp.reduced is not None:
                self._rode(resp)
            elif kind == Kind.ALLREDUCE:
                request, meta = resp.request, resp.meta
                entries = request.entries if request is not None else _zeros_entries(meta)
                for i, e in enumerate(entries):
                    assert e.input is not None and e.output is not None
                    # The fusion key: pieces reduced the same way share buckets.
                    key = (e.dtype, meta.reduce_op, meta.prescale, meta.postscale,
                           meta.device)
                    how = reductions.get(key)
                    if how is None:
                        how = reductions[key] = self._reduction(e.dtype, meta)
                    allreduce.append((key, Piece(resp, i, _flat(e.input), _flat(e.output),
                                                 e.dtype, how)))
            elif kind == Kind.BROADCAST and is_cuda(resp.meta):
                others.append(resp)  # staged through the host, one request at a time
            elif kind == Kind.BROADCAST:
                assert resp.request is not None
                for i, e in enumerate(resp.request.entries):
                    assert e.output is not None
                    src = e.input if e.input is not None else e.output
                    broadcast.append((resp.meta.root, Piece(resp, i, _flat(src),
                                                            _flat(e.output), e.dtype)))
            else:
                others.append(resp)
        threshold = self.fusion_threshold
        if allreduce:
            for bucket in plan(allreduce, threshold):
                self._allreduce(bucket)
        if broadcast:
            for bucket in plan(broadcast, threshold):
                self._broadcast(bucket)
        for resp in others:
            self._single(resp)

    def _reduction(self, dtype: str, meta: RequestMeta) -> ops.Reduction:
        """How the data plane reduces ``dtype`` pieces of requests like ``meta``: the one
        place an allreduce's Average becomes a Sum and a postscale."""
        op, post = average_as_sum(_OP_OF[meta.reduce_op], meta.postscale, self.group.size)
        return ops.Reduction(dtype, meta.prescale, post, op)

    # -------------------------------------------------------------------------- allreduce
    def _allreduce(self, bucket: list[Piece]) -> None:
        dtype = bucket[0].dtype
        meta = bucket[0].response.meta
        how = bucket[0].reduction  # the bucket's fusion key: every piece has the same
        assert how is not None
        op = how.op
        started = time.monotonic()
        self._queued(bucket, started)
        if is_cuda(meta):
            # Packed, reduced and unpacked on the device, ordered by CUDA events.
            requests = list({id(p.response): p.response.request for p in bucket}.values())
            self.device.allreduce([p.input for p in bucket], [p.output for p in bucket],
                                  requests, how)
            self.collectives += 1
            self.fused_tensors += len(bucket) if len(bucket) > 1 else 0
            self._span(bucket, "ALLREDUCE", started, time.monotonic(),
                       {"tensors": len(bucket), "device": "cuda"})
            return
        # Adasum is not elementwise: it needs each fused tensor's boundaries.
        counts = [p.input.size for p in bucket] if op == ReduceOp.ADASUM else None
        span = bucket[0].input if len(bucket) == 1 else _adjacent_in_place(bucket)
        if span is not None:
            # One tensor, or in-place pieces lying back to back in one buffer (gradients laid
            # out as views of a flat bucket): reduce where they are, no packing.
            out = bucket[0].output if len(bucket) == 1 else span
            ops.allreduce(self.group, span, out, how, counts, self.overrides)
            self._span(bucket, "ALLREDUCE", started, time.monotonic(),
                       {"bucket_bytes": int(span.nbytes), "tensors": len(bucket),
                        "packed": False})
            self.collectives += 1
            self.fused_tensors += len(bucket) if len(bucket) > 1 else 0
            self.zero_copy_buckets += len(bucket) > 1
            return
        total = sum(p.nbytes for p in bucket)
        fused = self.group.fusion_buffer(total).view(STORAGE[dtype])
        # One call packs them all (a slice assignment per piece cost 0.35 us each).
        np.concatenate([p.input for p in bucket], out=fused[:total // fused.itemsize])
        packed = time.monotonic()
        ops.allreduce(self.group, fused, fused, how, counts, self.overrides)
        reduced = time.monotonic()
        offset = 0
        for p in bucket:
            n = p.output.size
            p.output[...] = fused[offset:offset + n]
            offset += n
        done = time.monotonic()
        self.collectives += 1
        self.fused_tensors += len(bucket)
        if self.timeline.active:
            self._span(bucket, "MEMCPY_IN_FUSION_BUFFER", started, packed)
            self._span(bucket, "ALLREDUCE", packed, reduced,
                       {"bucket_bytes": total, "tensors": len(bucket)})
            self._span(bucket, "MEMCPY_OUT_FUSION_BUFFER", reduced, done)

    def _rode(self, resp: Response) -> None:
        """A small allreduce the round reduced already (.header): only its output to fill."""
        assert resp.request is not None and resp.reduced is not None
        output = resp.request.entries[0].output
        assert output is not None
        started = time.monotonic()
        _flat(output)[...] = resp.reduced.reshape(-1)
        self._span_request(resp, "ALLREDUCE_IN_ROUND", started, time.monotonic())

    # -------------------------------------------------------------------------- broadcast
    def _broadcast(self, bucket: list[Piece]) -> None:
        root = int(bucket[0].response.meta.root)
        is_root = self.group.rank == root
        started = time.monotonic()
        self._queued(bucket, started)
        if len(bucket) == 1:
            p = bucket[0]
            if is_root and p.input is not p.output:
                p.output[...] = p.input
            ops.broadcast(self.group, p.output.view(np.uint8), root)
            self._span(bucket, "BROADCAST", started, time.monotonic())
            self.collectives += 1
            return
        total = sum(p.nbytes for p in bucket)
        fused = self.group.fusion_buffer(total)
        offset = 0
        if is_root:
            for p in bucket:
                fused[offset:offset + p.nbytes] = p.input.view(np.uint8)
                if p.input is not p.output:
                    p.output[...] = p.input
                offset += p.nbytes
        ops.broadcast(self.group, fused, root)
        if not is_root:
            offset = 0
            for p in bucket:
                p.output.view(np.uint8)[...] = fused[offset:offset + p.nbytes]
                offset += p.nbytes
        self.collectives += 1
        self.fused_tensors += len(bucket)
        self._span(bucket, "BROADCAST", started, time.monotonic(),
                   {"bucket_bytes": total, "tensors": len(bucket)})

    # ---------------------------------------------------------------- one-at-a-time ops
    def _single(self, resp: Response) -> None:
        request = resp.request
        started = time.monotonic()
        kind = resp.kind
        if kind == Kind.BARRIER:
            # Negotiation only decides a barrier once every rank has entered it (or joined:
            # a joined rank has no request of its own here).
            self._span_request(resp, "BARRIER", started, started)
            return
        assert request is not None
        if is_cuda(resp.meta):
            with self.device.staged(request.entries):
                self._entries(resp, request)
        else:
            self._entries(resp, request)
        self._span_request(resp, kind.name, started, time.monotonic())

    def _entries(self, resp: Response, request: Request) -> None:
        kind = resp.kind
        for entry in request.entries:
            if kind == Kind.BROADCAST:  # CUDA broadcasts only: CPU ones are fused above
                self._broadcast_entry(int(resp.meta.root), entry)
                self.collectives += 1
                continue
            if kind == Kind.ALLGATHER:
                self._allgather(entry)
            elif kind == Kind.ALLTOALL:
                self._alltoall(entry)
            elif kind == Kind.REDUCESCATTER:
                self._reducescatter(request, entry)
            else:
                raise AssertionError(f"no executor for {kind!r}")
            self.collectives += 1

    def _broadcast_entry(self, root: int, entry: Entry) -> None:
        assert entry.output is not None
        if self.group.rank == root and entry.input is not None:
            entry.output[...] = entry.input
        ops.broadcast(self.group, _flat(entry.output).view(np.uint8), root)

    def _allocate(self, entry: Entry, shape: tuple[int, ...]) -> np.ndarray:
        assert entry.allocate is not None
        out = entry.allocate(shape)
        entry.output = out
        return out

    def _allgather(self, entry: Entry) -> None:
        assert entry.input is not None
        rows = entry.shape[0] if entry.shape else 1
        counts = ops.allgather_int(self.group, rows)
        row_shape = entry.shape[1:]
        out = self._allocate(entry, (sum(counts), *row_shape))
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * STORAGE[entry.dtype].itemsize
        ops.allgather(self.group, _flat(entry.input), _flat(out), [c * row_bytes for c in counts])

    def _alltoall(self, entry: Entry) -> None:
        assert entry.input is not None and entry.splits is not None
        received = ops.alltoall_int(self.group, entry.splits)
        row_shape = entry.shape[1:]
        out = self._allocate(entry, (sum(received), *row_shape))
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * STORAGE[entry.dtype].itemsize
        ops.alltoall(self.group, _flat(entry.input), [s * row_bytes for s in entry.splits],
                     _flat(out), [r * row_bytes for r in received])
        entry.received_splits = tuple(received)

    def _reducescatter(self, request: Request, entry: Entry) -> None:
        assert entry.input is not None
        size = self.group.size
        n = entry.shape[0]
        rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
        row_shape = entry.shape[1:]
        row_elems = int(np.prod(row_shape, dtype=np.int64))
        out = self._allocate(entry, (rows[self.group.rank], *row_shape))
        op, post = average_as_sum(request.op, request.postscale, size)
        ops.reducescatter(self.group, _flat(entry.input), _flat(out),
                          [r * row_elems for r in rows],
                          ops.Reduction(entry.dtype, request.prescale, post, op))

    # ---------------------------------------------------------------------- timeline
    def _queued(self, bucket: list[Piece], started: float) -> None:
        if not self.timeline.active:
            return
        seen = set()
        for p in bucket:
            resp = p.response
            if id(resp) in seen:
                continue
            seen.add(id(resp))
            if resp.request is not None:
                self.timeline.span(resp.name, f"NEGOTIATE_{resp.kind.name}",
                                   resp.request.submitted_at, resp.decided_at)
            self.timeline.span(resp.name, "QUEUE", resp.decided_at, started)

    def _span(self, bucket: list[Piece], phase: str, start: float, end: float,
              args: dict[str, Any] | None = None) -> None:
        if not self.timeline.active:
            return
        seen = set()
        for p in bucket:
            if id(p.response) not in seen:
                seen.add(id(p.response))
                self.timeline.span(p.response.name, phase, start, end, args)

    def _span_request(self, resp: Response, phase: str, start: float, end: float) -> None:
        if not self.timeline.active:
            return
        if resp.request is not None:
            self.timeline.span(resp.name, f"NEGOTIATE_{resp.kind.name}",
                               resp.request.submitted_at, resp.decided_at)
        self.timeline.span(resp.name, "QUEUE", resp.decided_at, start)
        self.timeline.span(resp.name, phase, start, end)
