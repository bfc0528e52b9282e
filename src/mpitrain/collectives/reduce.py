"""Reductions: allreduce (plain, in place, grouped) and reducescatter."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..core.dtypes import ReduceOp, check_reduce_supported
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from ..engine.request import Entry, Handle, Kind, Request
from . import arrays, wire
from .casts import Compressor, NoneCompressor
from .requests import (
    Average,
    as_list,
    check_adasum,
    device_kind,
    entry_in_place,
    entry_new_output,
    ready_events,
    refused_everywhere,
    request_name,
    resolve_op,
    scale_factor,
    submit,
    submit_for,
    wait_now,
)

# How one tensor of a reduction becomes an engine entry, given the checked op and scale
# factors: ``(tensor, what, op, prescale, postscale) -> (entry, what the caller keeps)``.
EntryMaker = Callable[[Any, str, ReduceOp, float, float], tuple[Entry, Any]]


def _reduction_request(kind: Kind, tensors: Sequence[Any], name: str | None, op: ReduceOp | Any,
                       average: bool | None, scales: tuple[Any, Any], process_set: ProcessSet,
                       make_entry: EntryMaker) -> tuple[Request, list[Any]]:
    """The request of an allreduce or a reducescatter, and what each tensor's caller keeps.

    The name comes first (see ``request_name``); every check after it raises inside
    ``refused_everywhere``, so that a rank's refusal reaches the other ranks too.
    """
    set_id = set_id_of(process_set)
    full_name = request_name(name, set_id, kind)  # first: see request_name
    with refused_everywhere(full_name, kind, set_id):
        reduce_op = resolve_op(op, average)
        pre = scale_factor(scales[0], "prescale_factor")
        post = scale_factor(scales[1], "postscale_factor")
        check_adasum(reduce_op, set_id)
        entries, kept = [], []
        for i, t in enumerate(tensors):
            what = "tensor" if len(tensors) == 1 else f"tensors[{i}]"
            entry, keep = make_entry(t, what, reduce_op, pre, post)
            entries.append(entry)
            kept.append(keep)
        device = device_kind(tensors, entries)
    request = Request(name=full_name, kind=kind, entries=entries, op=reduce_op,
                      prescale=pre, postscale=post, device=device,
                      ready=ready_events(tensors, device), process_set_id=set_id)
    return request, kept


def _submit_allreduce(tensors: list[Any], in_place: bool, name: str | None, op: Any,
                      average: bool | None, scales: tuple[Any, Any], process_set: ProcessSet,
                      *, grouped: bool) -> Handle:
    """Submit the allreduce of ``tensors``, into new tensors or (``in_place``) into themselves.

    The one submission behind the four ``*allreduce_async*`` functions, so that the in-place and
    grouped variants cannot drift apart: ``synchronize`` returns the list of results when
    ``grouped``, else the result of the one tensor.
    """
    def make_entry(t: Any, what: str, reduce_op: ReduceOp, pre: float,
                   post: float) -> tuple[Entry, Any]:
        if in_place:
            entry, out = entry_in_place(t, what), t
        else:
            entry, out = entry_new_output(t, what)
        check_reduce_supported(entry.dtype, reduce_op)
        if entry.dtype == "bool" and (pre != 1.0 or post != 1.0):
            raise ValueError(f"{what} is bool: scale factors must be 1, got "
                             f"prescale_factor={pre}, postscale_factor={post}")
        return entry, out

    request, outputs = _reduction_request(Kind.ALLREDUCE, tensors, name, op, average, scales,
                                          process_set, make_entry)
    return submit_for(request, outputs if grouped else outputs[0])


def allreduce_async(tensor: Any, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing ``tensor`` across the process set into a new tensor.

    Args:
        tensor: a contiguous torch CPU tensor or numpy array.
        average: deprecated; ``True`` means ``op=Average``, ``False`` means ``op=Sum``.
        name: a name unique among requests in flight; unnamed calls are numbered in order.
        op: Average (default), Sum, Min, Max, Product, or Adasum (adaptive summation of
            floating-point tensors over a power-of-two number of ranks; see
            :mod:`mpitrain.ops.adasum`).
        prescale_factor: multiplies every input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks taking part (default: all).

    Returns:
        A handle; ``synchronize(handle)`` returns the reduced tensor.
    """
    return _submit_allreduce([tensor], False, name, op, average,
                             (prescale_factor, postscale_factor), process_set, grouped=False)


def allreduce_async_(tensor: Any, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Like :func:`allreduce_async`, but the result overwrites ``tensor``."""
    return _submit_allreduce([tensor], True, name, op, average,
                             (prescale_factor, postscale_factor), process_set, grouped=False)


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = NoneCompressor, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` across the process set and return the result as a new tensor.

    Every rank of the process set must call this, in the same order.  ``compression``
    (e.g. ``Compression.fp16``) shrinks the tensor on the wire and restores its dtype after:
    a host float tensor is cast into a reused 16-bit buffer reduced in place (:mod:`.wire`).
    """
    narrowed = wire.narrow([tensor], compression)
    if narrowed is not None:
        wait_now(allreduce_async_, narrowed[0].buffer, average, name, op, prescale_factor,
                 postscale_factor, process_set)
        return wire.widened(narrowed)[0]
    compressed, ctx = compression.compress(tensor)
    reduced = wait_now(allreduce_async, compressed, average, name, op, prescale_factor,
                       postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(tensor: Any, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` in place across the process set and return it."""
    return wait_now(allreduce_async_, tensor, average, name, op, prescale_factor,
                    postscale_factor, process_set)


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a list of tensors as one negotiated, fused request.

    The arguments are :func:`allreduce_async`'s; ``synchronize(handle)`` returns the reduced
    tensors, new ones, in the order of ``tensors``.
    """
    return _submit_allreduce(as_list(tensors), False, name, op, average,
                             (prescale_factor, postscale_factor), process_set, grouped=True)


def grouped_allreduce_async_(tensors: Sequence[Any], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`: ``synchronize(handle)`` returns ``tensors``,
    each overwritten by its result."""
    return _submit_allreduce(as_list(tensors), True, name, op, average,
                             (prescale_factor, postscale_factor), process_set, grouped=True)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = NoneCompressor,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce a list of tensors together; returns new tensors in the same order."""
    narrowed = wire.narrow(as_list(tensors), compression)
    if narrowed is not None:
        wait_now(grouped_allreduce_async_, [n.buffer for n in narrowed], average, name, op,
                 prescale_factor, postscale_factor, process_set)
        return wire.widened(narrowed)
    pairs = [compression.compress(t) for t in as_list(tensors)]
    reduced = wait_now(grouped_allreduce_async, [p[0] for p in pairs], average, name, op,
                       prescale_factor, postscale_factor, process_set)
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(reduced, pairs)]


def grouped_allreduce_(tensors: Sequence[Any], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce a list of tensors together, in place; returns them."""
    return wait_now(grouped_allreduce_async_, tensors, average, name, op, prescale_factor,
                    postscale_factor, process_set)


def _reducescatter_request(tensors: Sequence[Any], name: str | None, op: Any,
                           prescale_factor: Any, postscale_factor: Any,
                           process_set: ProcessSet) -> tuple[Request, list[list[Any]]]:
    def make_entry(t: Any, what: str, reduce_op: ReduceOp, pre: float,
                   post: float) -> tuple[Entry, list[Any]]:
        dtype = arrays.check_tensor(t, what)
        if t.ndim == 0:
            raise ValueError(f"reducescatter needs {what} with at least one dimension, "
                             "got a scalar")
        check_reduce_supported(dtype, reduce_op)
        keep: list[Any] = []  # the allocator puts this rank's block here
        entry = Entry(input=arrays.storage_view(t), shape=tuple(t.shape), dtype=dtype,
                      allocate=arrays.allocator_like(t, keep))
        return entry, keep

    return _reduction_request(Kind.REDUCESCATTER, tensors, name, op, None,
                              (prescale_factor, postscale_factor), process_set, make_entry)


def reducescatter_async(tensor: Any, name: str | None = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start reducing ``tensor`` and scattering the rows: rank i keeps block i.

    With n rows over p ranks the first ``n % p`` ranks get one extra row.  The parameters
    come in Horovod's order (``process_set`` before the scale factors).  ``op=Adasum``
    (which Horovod 0.28.1 refuses) gives this rank's block of the Adasum allreduce of the
    whole tensor.
    """
    request, keeps = _reducescatter_request([tensor], name, op, prescale_factor,
                                            postscale_factor, process_set)
    return submit(request, lambda h: keeps[0][0])


def reducescatter(tensor: Any, name: str | None = None,
                  compression: type[Compressor] = NoneCompressor, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` across ranks and return this rank's block of rows.

    ``compression`` (e.g. ``Compression.fp16``) shrinks the tensor on the wire and restores
    its dtype after, as for :func:`allreduce`.
    """
    compressed, ctx = compression.compress(tensor)
    reduced = wait_now(reducescatter_async, compressed, name, op, process_set, prescale_factor,
                       postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of each tensor of a list, negotiated as one request."""
    request, keeps = _reducescatter_request(as_list(tensors), name, op, prescale_factor,
                                            postscale_factor, process_set)
    return submit(request, lambda h: [k[0] for k in keeps])


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          compression: type[Compressor] = NoneCompressor, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each tensor of a list; returns this rank's blocks in order."""
    pairs = [compression.compress(t) for t in as_list(tensors)]
    reduced = wait_now(grouped_reducescatter_async, [p[0] for p in pairs], name, op,
                       process_set, prescale_factor, postscale_factor)
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(reduced, pairs)]
