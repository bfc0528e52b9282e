"""Collectives that move data rather than combine it: allgather, broadcast, alltoall, and
the Python-object forms built on them."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import session
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from ..engine.request import Entry, Handle, Kind, Request
from . import arrays
from .requests import (
    as_list,
    device_kind,
    entry_in_place,
    entry_new_output,
    rank_within,
    ready_events,
    refused_everywhere,
    request_name,
    submit,
    submit_for,
    wait_now,
)


def _allgather_request(tensors: Sequence[Any], name: str | None,
                       process_set: ProcessSet) -> tuple[Request, list[list[Any]]]:
    set_id = set_id_of(process_set)
    full_name = request_name(name, set_id, Kind.ALLGATHER)  # first: see request_name
    with refused_everywhere(full_name, Kind.ALLGATHER, set_id):
        entries, keeps = [], []
        for i, t in enumerate(tensors):
            what = "tensor" if len(tensors) == 1 else f"tensors[{i}]"
            dtype = arrays.check_tensor(t, what)
            shape = tuple(t.shape) if t.ndim > 0 else (1,)
            keep: list[Any] = []
            entries.append(Entry(input=arrays.storage_view(t).reshape(shape), shape=shape,
                                 dtype=dtype, allocate=arrays.allocator_like(t, keep)))
            keeps.append(keep)
        device = device_kind(tensors)
    request = Request(name=full_name, kind=Kind.ALLGATHER, entries=entries, device=device,
                      ready=ready_events(tensors), process_set_id=set_id)
    return request, keeps


def allgather_async(tensor: Any, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along the first dimension.

    The first dimension may differ between ranks; the others must agree.  A 0-d tensor counts
    as one row.
    """
    request, keeps = _allgather_request([tensor], name, process_set)
    return submit(request, lambda h: keeps[0][0])


def allgather(tensor: Any, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order."""
    return wait_now(allgather_async, tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather of each tensor of a list, negotiated as one request."""
    request, keeps = _allgather_request(as_list(tensors), name, process_set)
    return submit(request, lambda h: [k[0] for k in keeps])


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allgather each tensor of a list; returns the gathered tensors in order."""
    return wait_now(grouped_allgather_async, tensors, name, process_set)

def _broadcast_request(tensor: Any, root_rank: int, in_place: bool, name: str | None,
                       process_set: ProcessSet) -> tuple[Request, Any]:
    set_id = set_id_of(process_set)
    full_name = request_name(name, set_id, Kind.BROADCAST)  # first: see request_name
    with refused_everywhere(full_name, Kind.BROADCAST, set_id):
        root = rank_within(process_set, root_rank)
        if in_place:
            entry, out = entry_in_place(tensor, "tensor"), tensor
        else:
            entry, out = entry_new_output(tensor, "tensor")
        device = device_kind([tensor], [entry])
    request = Request(name=full_name, kind=Kind.BROADCAST, entries=[entry], root=root,
                      device=device, ready=ready_events([tensor], device),
                      process_set_id=set_id)
    return request, out


def broadcast_async(tensor: Any, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start copying ``tensor`` of ``root_rank`` (a world rank) into a new tensor everywhere."""
    request, out = _broadcast_request(tensor, root_rank, False, name, process_set)
    return submit_for(request, out)


def broadcast_async_(tensor: Any, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start overwriting ``tensor`` everywhere with the one of ``root_rank``."""
    request, out = _broadcast_request(tensor, root_rank, True, name, process_set)
    return submit_for(request, out)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Return a copy of ``root_rank``'s ``tensor`` on every rank."""
    return wait_now(broadcast_async, tensor, root_rank, name, process_set)


def broadcast_(tensor: Any, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> Any:
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns it."""
    return wait_now(broadcast_async_, tensor, root_rank, name, process_set)

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
    set_id = set_id_of(process_set)
    size = len(session.engine().process_set(set_id).world_ranks)
    full_name = request_name(name, set_id, Kind.ALLTOALL)  # first: see request_name
    with refused_everywhere(full_name, Kind.ALLTOALL, set_id):
        dtype = arrays.check_tensor(tensor, "tensor")
        if tensor.ndim == 0:
            raise ValueError("alltoall needs a tensor with at least one dimension, got a "
                             "scalar")
        split_list = _alltoall_splits(splits, int(tensor.shape[0]), size)
        keep: list[Any] = []
        entry = Entry(input=arrays.storage_view(tensor), shape=tuple(tensor.shape),
                      dtype=dtype, allocate=arrays.allocator_like(tensor, keep),
                      splits=tuple(split_list))
        device = device_kind([tensor])
    request = Request(name=full_name, kind=Kind.ALLTOALL, entries=[entry], device=device,
                      ready=ready_events([tensor]), process_set_id=set_id)

    def finish(h: Handle) -> tuple[Any, Any]:
        received = list(entry.received_splits or ())
        if arrays.is_torch(tensor):
            torch = arrays.loaded_torch()
            return keep[0], torch.tensor(received, dtype=torch.int32)
        return keep[0], np.asarray(received, dtype=np.int32)

    return submit(request, finish)


def _alltoall_splits(splits: Any, rows: int, size: int) -> list[int]:
    """The rows for each rank: ``splits`` checked, or an even split."""
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs the first dimension ({rows}) to "
                             f"be divisible by the number of ranks ({size}); pass splits=")
        return [rows // size] * size
    raw = splits.tolist() if hasattr(splits, "tolist") else list(splits)
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in raw):
        # ValueError, not TypeError: Horovod's contract for a splits tensor of the wrong
        # dtype (its scripts catch ValueError), and it is the value that is wrong.
        raise ValueError(f"splits must be integers (an int tensor or list), got {raw}")
    split_list = [int(s) for s in raw]
    if len(split_list) != size or any(s < 0 for s in split_list) or sum(split_list) != rows:
        raise ValueError(f"splits={split_list} must have {size} non-negative entries summing "
                         f"to the first dimension {rows}")
    return split_list


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> tuple[Any, Any]:
    """Exchange rows with every rank; returns ``(output, received_splits)``."""
    result: tuple[Any, Any] = wait_now(alltoall_async, tensor, splits, name, process_set)
    return result

def _dumps(obj: Any) -> np.ndarray:
    """``obj`` as bytes: with cloudpickle when it is installed, as Horovod (which requires it)
    does, so lambdas and functions defined in the script travel too; plain pickle otherwise.
    Either output is read back with ``pickle.loads``."""
    try:
        import cloudpickle  # optional: used when installed, as Horovod does; pickle otherwise
    except ImportError:
        data = pickle.dumps(obj)
    else:
        data = cloudpickle.dumps(obj)
    return np.frombuffer(data, dtype=np.uint8)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled; see :func:`_dumps`)."""
    set_id = set_id_of(process_set)
    base = name or session.engine().next_name(set_id, Kind.BROADCAST) + ".object"
    me = session.engine().process_set(set_id).rank
    is_root = me == rank_within(process_set, root_rank)
    payload = _dumps(obj) if is_root else None
    length = np.array([payload.size if payload is not None else 0], dtype=np.int64)
    broadcast_(length, root_rank, name=base + ".size", process_set=process_set)
    data = payload.copy() if payload is not None else np.empty(int(length[0]), dtype=np.uint8)
    broadcast_(data, root_rank, name=base + ".data", process_set=process_set)
    return obj if is_root else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return a list of every rank's ``obj``, in rank order."""
    set_id = set_id_of(process_set)
    base = name or session.engine().next_name(set_id, Kind.ALLGATHER) + ".object"
    payload = _dumps(obj)
    sizes = allgather(np.array([payload.size], dtype=np.int64), name=base + ".sizes",
                      process_set=process_set)
    data = allgather(payload.copy(), name=base + ".data", process_set=process_set)
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
