"""What every collective of the front door shares: turning the caller's arguments into one
validated, named engine request, submitting it, and waiting for its handle.

Bad input raises ``ValueError`` or ``TypeError`` naming the value, here at the call, on the
calling rank; what only the ranks together can check (shapes, names, ops agreeing) the engine
negotiates.  The engine is reached through :func:`mpitrain.session.engine` and nowhere else.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import session
from ..core.adasum_layout import check_layout
from ..core.dtypes import ReduceOp
from ..core.errors import MpitrainInternalError
from ..core.memory import RECYCLER
from ..core.process_sets import ProcessSet, set_id_of
from ..engine import device
from ..engine.request import Entry, Handle, Kind, Request, refusal
from . import arrays

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT


def resolve_op(op: Any, average: bool | None) -> ReduceOp:
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


def check_adasum(reduce_op: ReduceOp, set_id: int) -> None:
    """Adasum needs a power-of-two number of ranks (of nodes, hierarchical): say so now, at
    the call, rather than fail the collective on every rank."""
    if reduce_op != Adasum:
        return
    group = session.engine().process_set(set_id).group
    if group is not None:
        check_layout(group.topology, group.config.adasum_hierarchical)


def check_adasum_layout(process_set: ProcessSet) -> None:
    """Raise :class:`mpitrain.core.adasum_layout.AdasumLayoutError` unless ``process_set`` can run
    Adasum (a rank outside the set has nothing to check)."""
    check_adasum(Adasum, set_id_of(process_set))


def scale_factor(value: Any, what: str) -> float:
    if type(value) is float and value == 1.0:  # the common case, checked cheaply
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{what} must be a number, got {value!r}")
    f = float(value)
    if not np.isfinite(f):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return f


def rank_within(process_set: ProcessSet, world_rank: Any, what: str = "root_rank") -> int:
    if isinstance(world_rank, bool) or not isinstance(world_rank, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {world_rank!r}")
    set_id = set_id_of(process_set)
    ranks = session.engine().process_set(set_id).world_ranks
    if int(world_rank) not in ranks:
        raise ValueError(f"{what}={world_rank} is not a rank of the process set {ranks}")
    return ranks.index(int(world_rank))


def request_name(name: str | None, set_id: int, kind: Kind) -> str:
    """The request's name: ``name``, or the next generated one of ``kind`` in the set.

    Call it before validating anything else: a generated name is the next number of a counter
    every rank keeps, and a call refused on one rank must use its number up there as on the
    ranks whose call went through, or every later unnamed collective would pair with another
    rank's previous one.
    """
    if name is None:
        return str(session.engine().next_name(set_id, kind))
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    return name


class refused_everywhere:  # named as the function it replaced: `with refused_everywhere(...)`
    """Around a call's validation: if this rank refuses its arguments, tell the other ranks
    before raising, so that their submissions of the same collective fail at once with this
    rank's reason (the engine negotiates a stand-in request, ``request.refusal``) instead of
    waiting for a call that will never come.

    A class rather than a generator-based context manager: every submission enters one, and
    contextlib's costs a few microseconds of a 25-microsecond call.
    """

    __slots__ = ("kind", "name", "set_id")

    def __init__(self, name: str, kind: Kind, set_id: int) -> None:
        self.name, self.kind, self.set_id = name, kind, set_id

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: Any) -> None:
        if exc_type is not None and issubclass(exc_type, (ValueError, TypeError)):
            with contextlib.suppress(ValueError, MpitrainInternalError):  # not a member, stopped
                session.engine().submit(refusal(self.name, self.kind, self.set_id,
                                                f"{exc_type.__name__}: {exc}"))
        # (None: the exception, if any, goes on)


class _Blocking(threading.local):
    """Set on a thread while it submits a call it will wait for at once (see wait_now)."""

    now = False


_blocking = _Blocking()


def submit(request: Request, finish: Callable[[Handle], Any] | None) -> Handle:
    """Submit ``request``; ``finish(handle)`` makes what ``synchronize`` returns, once."""
    handle: Handle = session.engine().submit(request, wake=not _blocking.now)
    handle._finish = finish
    return handle


def submit_for(request: Request, result: Any) -> Handle:
    """Submit ``request`` whose ``synchronize`` returns ``result`` (tensors the engine fills).

    No closure per call: a burst of a thousand requests keeps every handle alive across
    several of Python's younger collections, and each object it holds brings the next full
    collection nearer (see :mod:`mpitrain.core.collector`).
    """
    handle: Handle = session.engine().submit(request, wake=not _blocking.now)
    handle.result = result
    return handle


def wait_now(start: Callable[..., Handle], *args: Any) -> Any:
    """A blocking call: submit through ``start(*args)`` (an ``*_async`` function) and wait.

    The engine thread is not woken for it: this thread runs the engine's cycles itself while it
    waits (:mod:`mpitrain.engine.driver`), so a synchronous collective costs no hand-over
    between threads.
    """
    _blocking.now = True
    try:
        handle = start(*args)
    finally:
        _blocking.now = False
    return synchronize(handle)


def entry_in_place(tensor: Any, what: str) -> Entry:
    plain = arrays.plain_host_tensor(tensor)
    if plain is not None:
        dtype, view = plain
        return Entry(input=view, shape=view.shape, dtype=dtype, output=view)
    dtype = arrays.check_tensor(tensor, what)
    view = arrays.storage_view(tensor)
    return Entry(input=view, shape=tuple(tensor.shape), dtype=dtype, output=view)


def entry_new_output(tensor: Any, what: str) -> tuple[Entry, Any]:
    plain = arrays.plain_host_tensor(tensor)
    if plain is not None and plain[1].nbytes < RECYCLER.min_bytes:
        dtype, view = plain
        out, out_view = arrays.new_host_tensor(view, dtype)
        return Entry(input=view, shape=view.shape, dtype=dtype, output=out_view), out
    dtype = arrays.check_tensor(tensor, what)
    out, out_view = arrays.empty_like(tensor)
    entry = Entry(input=arrays.storage_view(tensor), shape=tuple(tensor.shape), dtype=dtype,
                  output=out_view)
    return entry, out


def device_kind(tensors: Sequence[Any], entries: Sequence[Entry] = ()) -> str:
    """The device kind (``cpu``/``cuda``) negotiated with the other ranks; ``entries``, when
    given, are the tensors' entries: numpy storage views say host memory at once."""
    if len(entries) == 1:
        if type(entries[0].input) is np.ndarray:
            return "cpu"
    elif entries and all(type(e.input) is np.ndarray for e in entries):
        return "cpu"
    if len(tensors) == 1:
        return arrays.device_of(tensors[0])
    devices = {(arrays.device_of(t), arrays.device_index(t)) for t in tensors}
    if len(devices) > 1:
        named = sorted(k if i is None else f"{k}:{i}" for k, i in devices)
        raise ValueError(f"tensors of one grouped call must share a device, got {named}")
    return devices.pop()[0] if devices else "cpu"


def ready_events(tensors: Sequence[Any], kind: str | None = None) -> Any:
    """For CUDA tensors: events on the framework's current streams, recorded now, that the
    device data plane waits for before reading them (see :mod:`mpitrain.engine.device`).
    ``kind``: the tensors' device kind, when known (``device_kind``)."""
    if kind == "cpu" or not tensors or not arrays.is_cuda(tensors[0]):
        return None
    return device.mark_ready([arrays.current_stream(t) for t in tensors])


def as_list(tensors: Any) -> list[Any]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"grouped ops take a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    return list(tensors)


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
