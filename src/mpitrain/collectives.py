"""Horovod's collective operations on torch CPU tensors and numpy arrays.

Every function here validates its arguments at the call (bad input raises ``ValueError`` or
``TypeError`` naming the value), turns the arrays into engine entries without copying, and
submits one named request.  The ``_async`` forms return a handle for :func:`poll` and
:func:`synchronize`; a trailing underscore means in place.  Autograd lives one layer up, in
:mod:`mpitrain.torch.mpi_ops`.

Every rank of the process set must call each collective, with the same name (or in the same
order when unnamed), the same shapes beyond what the op allows to differ, and the same
arguments; the engine checks this and fails all ranks with a clear error otherwise.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import arrays, runtime
from .adasum_layout import check_layout
from .compression import Compression, Compressor
from .dtypes import ReduceOp, check_reduce_supported
from .engine import device
from .engine.request import Entry, Handle, Kind, Request
from .errors import MpitrainInternalError
from .process_sets import ProcessSet, _set_of, global_process_set

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


# ------------------------------------------------------------------------------ helpers
def _engine() -> Any:
    return runtime.state().engine


def _resolve_op(op: Any, average: bool | None) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both "
                             f"(got op={op!r}, average={average!r})")
        warnings.warn("average= is deprecated; use op=mpitrain.Average or op=mpitrain.Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    try:
        resolved = ReduceOp(op)
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}; use Average, Sum, Adasum, Min, Max or "
                         "Product") from None
    return resolved


def _check_adasum(reduce_op: ReduceOp, set_id: int) -> None:
    """Adasum needs a power-of-two number of ranks (of nodes, hierarchical): say so now, at
    the call, rather than fail the collective on every rank."""
    if reduce_op != Adasum:
        return
    group = _engine().process_set(set_id).group
    if group is not None:
        check_layout(group.topology, group.config.adasum_hierarchical)


def _factor(value: Any, what: str) -> float:
    if type(value) is float and value == 1.0:  # the common case, checked cheaply
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{what} must be a number, got {value!r}")
    f = float(value)
    if not np.isfinite(f):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return f


def _set_rank(process_set: ProcessSet, world_rank: Any, what: str = "root_rank") -> int:
    if isinstance(world_rank, bool) or not isinstance(world_rank, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {world_rank!r}")
    set_id = _set_of(process_set)
    ranks = _engine().process_set(set_id).world_ranks
    if int(world_rank) not in ranks:
        raise ValueError(f"{what}={world_rank} is not a rank of the process set {ranks}")
    return ranks.index(int(world_rank))


def _name(name: str | None, set_id: int, kind: Kind) -> str:
    if name is None:
        return str(_engine().next_name(set_id, kind))
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


def _submit(request: Request, finish: Any) -> Handle:
    handle: Handle = _engine().submit(request)
    handle._finish = finish
    return handle


def _entry_in_place(tensor: Any, what: str) -> Entry:
    dtype = arrays.check_tensor(tensor, what)
    view = arrays.storage_view(tensor)
    return Entry(input=view, shape=tuple(tensor.shape), dtype=dtype, output=view)


def _entry_new_output(tensor: Any, what: str) -> tuple[Entry, Any]:
    dtype = arrays.check_tensor(tensor, what)
    out, out_view = arrays.empty_like(tensor)
    entry = Entry(input=arrays.storage_view(tensor), shape=tuple(tensor.shape), dtype=dtype,
                  output=out_view)
    return entry, out


def _device(tensors: Sequence[Any]) -> str:
    """The device kind (``cpu``/``cuda``) negotiated with the other ranks."""
    if len(tensors) == 1:
        return arrays.device_of(tensors[0])
    devices = {(arrays.device_of(t), arrays.device_index(t)) for t in tensors}
    if len(devices) > 1:
        named = sorted(k if i is None else f"{k}:{i}" for k, i in devices)
        raise ValueError(f"tensors of one grouped call must share a device, got {named}")
    return devices.pop()[0] if devices else "cpu"


def _ready(tensors: Sequence[Any]) -> Any:
    """For CUDA tensors: events on the framework's current streams, recorded now, that the
    device data plane waits for before reading them (see :mod:`mpitrain.engine.device`)."""
    if not tensors or not arrays.is_cuda(tensors[0]):
        return None
    return device.mark_ready([arrays.current_stream(t) for t in tensors])


# ------------------------------------------------------------------------------ allreduce
def _allreduce_request(tensors: Sequence[Any], in_place: bool, name: str | None, op: Any,
                       average: bool | None, prescale_factor: Any, postscale_factor: Any,
                       process_set: ProcessSet) -> tuple[Request, list[Any]]:
    reduce_op = _resolve_op(op, average)
    pre = _factor(prescale_factor, "prescale_factor")
    post = _factor(postscale_factor, "postscale_factor")
    set_id = _set_of(process_set)
    _check_adasum(reduce_op, set_id)
    entries, outputs = [], []
    for i, t in enumerate(tensors):
        what = "tensor" if len(tensors) == 1 else f"tensors[{i}]"
        if in_place:
            entry, out = _entry_in_place(t, what), t
        else:
            entry, out = _entry_new_output(t, what)
        check_reduce_supported(entry.dtype, reduce_op)
        if entry.dtype == "bool" and (pre != 1.0 or post != 1.0):
            raise ValueError(f"{what} is bool: scale factors must be 1, got prescale_factor="
                             f"{pre}, postscale_factor={post}")
        entries.append(entry)
        outputs.append(out)
    request = Request(name=_name(name, set_id, Kind.ALLREDUCE), kind=Kind.ALLREDUCE,
                      entries=entries, op=reduce_op, prescale=pre, postscale=post,
                      device=_device(tensors), ready=_ready(tensors), process_set_id=set_id)
    return request, outputs


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
    request, outputs = _allreduce_request([tensor], False, name, op, average, prescale_factor,
                                          postscale_factor, process_set)
    return _submit(request, lambda h: outputs[0])


def allreduce_async_(tensor: Any, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Like :func:`allreduce_async`, but the result overwrites ``tensor``."""
    request, outputs = _allreduce_request([tensor], True, name, op, average, prescale_factor,
                                          postscale_factor, process_set)
    return _submit(request, lambda h: outputs[0])


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` across the process set and return the result as a new tensor.

    Every rank of the process set must call this, in the same order.  ``compression``
    (e.g. ``Compression.fp16``) shrinks the tensor on the wire and restores its dtype after.
    """
    compressed, ctx = compression.compress(tensor)
    handle = allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor,
                             process_set)
    return compression.decompress(synchronize(handle), ctx)


def allreduce_(tensor: Any, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Any:
    """Reduce ``tensor`` in place across the process set and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a list of tensors as one negotiated, fused request."""
    request, outputs = _allreduce_request(_as_list(tensors), False, name, op, average,
                                          prescale_factor, postscale_factor, process_set)
    return _submit(request, lambda h: outputs)


def grouped_allreduce_async_(tensors: Sequence[Any], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`."""
    request, outputs = _allreduce_request(_as_list(tensors), True, name, op, average,
                                          prescale_factor, postscale_factor, process_set)
    return _submit(request, lambda h: outputs)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce a list of tensors together; returns new tensors in the same order."""
    pairs = [compression.compress(t) for t in _as_list(tensors)]
    handle = grouped_allreduce_async([p[0] for p in pairs], average, name, op, prescale_factor,
                                     postscale_factor, process_set)
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(synchronize(handle), pairs)]


def grouped_allreduce_(tensors: Sequence[Any], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[Any]:
    """Reduce a list of tensors together, in place; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def _as_list(tensors: Any) -> list[Any]:
    if isinstance(tensors, (torch.Tensor, np.ndarray)) or not isinstance(tensors,
                                                                        (list, tuple)):
        raise TypeError(f"grouped ops take a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    return list(tensors)


# ------------------------------------------------------------------------------ allgather
def _allgather_request(tensors: Sequence[Any], name: str | None,
                       process_set: ProcessSet) -> tuple[Request, list[list[Any]]]:
    set_id = _set_of(process_set)
    entries, keeps = [], []
    for i, t in enumerate(tensors):
        what = "tensor" if len(tensors) == 1 else f"tensors[{i}]"
        dtype = arrays.check_tensor(t, what)
        shape = tuple(t.shape) if t.ndim > 0 else (1,)
        keep: list[Any] = []
        entries.append(Entry(input=arrays.storage_view(t).reshape(shape), shape=shape,
                             dtype=dtype, allocate=arrays.allocator_like(t, keep)))
        keeps.append(keep)
    request = Request(name=_name(name, set_id, Kind.ALLGATHER), kind=Kind.ALLGATHER,
                      entries=entries, device=_device(tensors), ready=_ready(tensors),
                      process_set_id=set_id)
    return request, keeps


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along the first dimension.

    The first dimension may differ between ranks; the others must agree.  A 0-d tensor counts
    as one row.
    """
    request, keeps = _allgather_request([tensor], name, process_set)
    return _submit(request, lambda h: keeps[0][0])


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order."""
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather of each tensor of a list, negotiated as one request."""
    request, keeps = _allgather_request(_as_list(tensors), name, process_set)
    return _submit(request, lambda h: [k[0] for k in keeps])


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allgather each tensor of a list; returns the gathered tensors in order."""
    return synchronize(grouped_allgather_async(tensors, name, process_set))


# ------------------------------------------------------------------------------ broadcast
def _broadcast_request(tensor: Any, root_rank: int, in_place: bool, name: str | None,
                       process_set: ProcessSet) -> tuple[Request, Any]:
    root = _set_rank(process_set, root_rank)
    set_id = _set_of(process_set)
    if in_place:
        entry, out = _entry_in_place(tensor, "tensor"), tensor
    else:
        entry, out = _entry_new_output(tensor, "tensor")
    request = Request(name=_name(name, set_id, Kind.BROADCAST), kind=Kind.BROADCAST,
                      entries=[entry], root=root, device=_device([tensor]), ready=_ready([tensor]),
                      process_set_id=set_id)
    return request, out


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start copying ``tensor`` of ``root_rank`` (a world rank) into a new tensor everywhere."""
    request, out = _broadcast_request(tensor, root_rank, False, name, process_set)
    return _submit(request, lambda h: out)


def broadcast_async_(tensor: Any, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start overwriting ``tensor`` everywhere with the one of ``root_rank``."""
    request, out = _broadcast_request(tensor, root_rank, True, name, process_set)
    return _submit(request, lambda h: out)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return a copy of ``root_rank``'s ``tensor`` on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_(tensor: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------------------- alltoall
def alltoall_async(tensor: Any, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start scattering rows of ``tensor`` to every rank and gathering theirs.

    Args:
        tensor: rows to send (first dimension), split consecutively among the ranks.
        splits: rows for each rank (length = set size, non-negative, summing to the first
            dimension); by default the rows are split evenly, which needs divisibility.

    Raises:
        ValueError: ``splits`` holds non-integers (a float tensor, say), has the wrong
            length, a negative entry or the wrong sum; or no splits and rows not divisible.

    Returns:
        A handle; ``synchronize`` gives ``(output, received_splits)``.
    """
    set_id = _set_of(process_set)
    size = len(_engine().process_set(set_id).world_ranks)
    dtype = arrays.check_tensor(tensor, "tensor")
    if tensor.ndim == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension, got a scalar")
    rows = int(tensor.shape[0])
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs the first dimension ({rows}) to "
                             f"be divisible by the number of ranks ({size}); pass splits=")
        split_list = [rows // size] * size
    else:
        raw = splits.tolist() if hasattr(splits, "tolist") else list(splits)
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in raw):
            # ValueError, not TypeError: Horovod's contract for a splits tensor of the wrong
            # dtype (its scripts catch ValueError), and it is the value that is wrong.
            raise ValueError(f"splits must be integers (an int tensor or list), got {raw}")
        split_list = [int(s) for s in raw]
        if len(split_list) != size or any(s < 0 for s in split_list) or sum(split_list) != rows:
            raise ValueError(f"splits={split_list} must have {size} non-negative entries summing "
                             f"to the first dimension {rows}")
    keep: list[Any] = []
    entry = Entry(input=arrays.storage_view(tensor), shape=tuple(tensor.shape), dtype=dtype,
                  allocate=arrays.allocator_like(tensor, keep), splits=tuple(split_list))
    request = Request(name=_name(name, set_id, Kind.ALLTOALL), kind=Kind.ALLTOALL,
                      entries=[entry], device=_device([tensor]), ready=_ready([tensor]),
                      process_set_id=set_id)

    def finish(h: Handle) -> tuple[Any, Any]:
        received = list(entry.received_splits or ())
        if arrays.is_torch(tensor):
            return keep[0], torch.tensor(received, dtype=torch.int32)
        return keep[0], np.asarray(received, dtype=np.int32)

    return _submit(request, finish)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[Any, Any]:
    """Exchange rows with every rank; returns ``(output, received_splits)``."""
    result: tuple[Any, Any] = synchronize(alltoall_async(tensor, splits, name, process_set))
    return result


# -------------------------------------------------------------------------- reducescatter
def _reducescatter_request(tensors: Sequence[Any], name: str | None, op: Any,
                           prescale_factor: Any, postscale_factor: Any,
                           process_set: ProcessSet) -> tuple[Request, list[list[Any]]]:
    reduce_op = _resolve_op(op, None)
    pre = _factor(prescale_factor, "prescale_factor")
    post = _factor(postscale_factor, "postscale_factor")
    set_id = _set_of(process_set)
    _check_adasum(reduce_op, set_id)
    entries, keeps = [], []
    for i, t in enumerate(tensors):
        what = "tensor" if len(tensors) == 1 else f"tensors[{i}]"
        dtype = arrays.check_tensor(t, what)
        if t.ndim == 0:
            raise ValueError(f"reducescatter needs {what} with at least one dimension, got a "
                             "scalar")
        check_reduce_supported(dtype, reduce_op)
        keep: list[Any] = []
        entries.append(Entry(input=arrays.storage_view(t), shape=tuple(t.shape), dtype=dtype,
                             allocate=arrays.allocator_like(t, keep)))
        keeps.append(keep)
    request = Request(name=_name(name, set_id, Kind.REDUCESCATTER), kind=Kind.REDUCESCATTER,
                      entries=entries, op=reduce_op, prescale=pre, postscale=post,
                      device=_device(tensors), ready=_ready(tensors), process_set_id=set_id)
    return request, keeps


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
    return _submit(request, lambda h: keeps[0][0])


def reducescatter(tensor: Any, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce ``tensor`` across ranks and return this rank's block of rows.

    ``compression`` (e.g. ``Compression.fp16``) shrinks the tensor on the wire and restores
    its dtype after, as for :func:`allreduce`.
    """
    compressed, ctx = compression.compress(tensor)
    handle = reducescatter_async(compressed, name, op, process_set, prescale_factor,
                                 postscale_factor)
    return compression.decompress(synchronize(handle), ctx)


def grouped_reducescatter_async(tensors: Sequence[Any], name: str | None = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of each tensor of a list, negotiated as one request."""
    request, keeps = _reducescatter_request(_as_list(tensors), name, op, prescale_factor,
                                            postscale_factor, process_set)
    return _submit(request, lambda h: [k[0] for k in keeps])


def grouped_reducescatter(tensors: Sequence[Any], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each tensor of a list; returns this rank's blocks in order."""
    pairs = [compression.compress(t) for t in _as_list(tensors)]
    handle = grouped_reducescatter_async([p[0] for p in pairs], name, op, process_set,
                                         prescale_factor, postscale_factor)
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(synchronize(handle), pairs)]


# ----------------------------------------------------------------------- barrier and join
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier()."""
    set_id = _set_of(process_set)
    request = Request(name=_name(None, set_id, Kind.BARRIER), kind=Kind.BARRIER, entries=[],
                      process_set_id=set_id)
    synchronize(_submit(request, None))


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Declare that this rank has no more data; wait until every rank has joined.

    Meanwhile, allreduces submitted by the other ranks proceed with zeros from this rank
    (Average still divides by the full size).

    Returns:
        The rank that joined last.
    """
    del device  # accepted for Horovod compatibility; the engine needs no device here
    set_id = _set_of(process_set)
    request = Request(name=_name(None, set_id, Kind.JOIN), kind=Kind.JOIN, entries=[],
                      process_set_id=set_id)
    return int(synchronize(_submit(request, None)))


# -------------------------------------------------------------------------- handles
def poll(handle: Handle) -> bool:
    """True when the asynchronous operation behind ``handle`` has finished."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll takes a handle from an *_async call, got {type(handle).__name__}")
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s operation and return its result.

    Raises:
        MpitrainInternalError: the operation failed on some rank (mismatch, shutdown, stall).
    """
    if not isinstance(handle, Handle):
        hint = ("; sparse_allreduce_async returns a function: call it for the result"
                if callable(handle) else "")
        raise TypeError(f"synchronize takes a handle from an *_async call, got "
                        f"{type(handle).__name__}{hint}")
    return handle.wait()


# ------------------------------------------------------------------------------ objects
def _dumps(obj: Any) -> np.ndarray:
    """``obj`` as bytes: with cloudpickle when it is installed, as Horovod (which requires it)
    does, so lambdas and functions defined in the script travel too; plain pickle otherwise.
    Either output is read back with ``pickle.loads``."""
    try:
        import cloudpickle
    except ImportError:
        data = pickle.dumps(obj)
    else:
        data = cloudpickle.dumps(obj)
    return np.frombuffer(data, dtype=np.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; see :func:`_dumps`)."""
    set_id = _set_of(process_set)
    base = name or _engine().next_name(set_id, Kind.BROADCAST) + ".object"
    me = _engine().process_set(set_id).rank
    is_root = me == _set_rank(process_set, root_rank)
    payload = _dumps(obj) if is_root else None
    length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
    broadcast_(length, root_rank, name=base + ".size", process_set=process_set)
    data = payload.copy() if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
    broadcast_(data, root_rank, name=base + ".data", process_set=process_set)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return a list of every rank's ``obj``, in rank order."""
    set_id = _set_of(process_set)
    base = name or _engine().next_name(set_id, Kind.ALLGATHER) + ".object"
    payload = _dumps(obj)
    sizes = allgather(np.array([payload.size], dtype=np.int64), name=base + ".sizes",
                      process_set=process_set)
    data = allgather(payload.copy(), name=base + ".data", process_set=process_set)
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out


# ------------------------------------------------------------------------------ timeline
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (written by rank 0)."""
    runtime.state().engine.timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline and close its file (a valid JSON array)."""
    runtime.state().engine.timeline.stop()


__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "MpitrainInternalError",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
