"""Requests the adapters submit, and the handles they wait on.

A request is one named collective: a single tensor, or a group of tensors negotiated and
executed together (Horovod's grouped ops).  Its ``meta`` (a :class:`RequestMeta`) is
everything that must be equal on every rank for the collective to be well defined; the engine
compares metas across ranks before anything moves.
"""

from __future__ import annotations

import enum
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..core.dtypes import ReduceOp
from ..core.errors import CollectiveMismatchError, MpitrainInternalError


class Kind(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_SET = 7
    REMOVE_SET = 8

    @property
    def label(self) -> str:
        return self.name.lower()


# Names the engine gives unnamed requests: a fresh number per call, so they never repeat.
_GENERATED_NAME = re.compile(r"[a-z_]+\.noname\.\d+(\.set\d+)?")


def generated_name(kind: Kind, n: int, set_id: int) -> str:
    """The name of the ``n``-th unnamed request of ``kind`` in process set ``set_id``."""
    suffix = "" if set_id == 0 else f".set{set_id}"
    return f"{kind.label}.noname.{n}{suffix}"


def is_generated(name: str) -> bool:
    """Whether ``name`` came from :func:`generated_name` (and so will not come back)."""
    return _GENERATED_NAME.fullmatch(name) is not None


def average_as_sum(op: ReduceOp, postscale: float, size: int) -> tuple[ReduceOp, float]:
    """The data plane only sums: an average is a sum scaled by 1/size after."""
    if op == ReduceOp.AVERAGE:
        return ReduceOp.SUM, postscale / size
    return op, postscale


# Ops whose first dimension may differ between ranks (only the rest is negotiated).
_RAGGED = (Kind.ALLGATHER, Kind.ALLTOALL)

# One tensor's part of a meta: (dtype, number of dimensions, shape); the shape leaves out the
# first dimension for ragged ops.  Compared position by position with ENTRY_FIELDS' labels.
EntryMeta = tuple[str, int, tuple[int, ...]]


class RequestMeta(NamedTuple):
    """What every rank must agree on before a request may run, compared field by field.

    It crosses the wire as the plain tuple of its fields (see ``Negotiator``), so the field
    order is part of the negotiation exchange; :data:`META_FIELDS` labels them in messages.
    """

    kind: int  # a Kind
    reduce_op: int  # a ReduceOp
    prescale: float
    postscale: float
    root: int  # rank within the process set; -1 for ops without a root
    device: str  # "cpu" or "cuda" (engine.device)
    tensors: tuple[EntryMeta, ...]  # one per tensor, see EntryMeta
    payload: Any  # control requests: the ranks of a set to add / the id to remove


def _new_meta(fields: tuple[Any, ...]) -> RequestMeta:
    return tuple.__new__(RequestMeta, fields)


@dataclass(eq=False)
class Entry:
    """One tensor of a request, as flat storage arrays the data plane can use."""

    input: np.ndarray | None
    shape: tuple[int, ...]
    dtype: str
    output: np.ndarray | None = None  # preallocated (allreduce, broadcast) or filled later
    allocate: Callable[[tuple[int, ...]], np.ndarray] | None = None
    splits: tuple[int, ...] | None = None  # alltoall: rows sent to each rank
    received_splits: tuple[int, ...] | None = None  # alltoall: rows received from each rank

    def meta(self, kind: Kind) -> EntryMeta:
        shape_key = self.shape[1:] if kind in _RAGGED else self.shape
        return (self.dtype, len(self.shape), shape_key)


@dataclass(eq=False)
class Request:
    """One negotiated collective."""

    name: str
    kind: Kind
    entries: list[Entry]
    op: ReduceOp = ReduceOp.SUM
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1  # rank within the process set
    device: str = "cpu"
    process_set_id: int = 0
    payload: Any = None  # control requests: the ranks of a set to add / the id to remove
    ready: Any = None  # CUDA: events recorded at submission (engine.device.ReadyMark)
    handle: Handle | None = None
    submitted_at: float = field(default_factory=time.monotonic)

    def meta(self) -> RequestMeta:
        """What every rank must agree on before this request may run.

        Plain ints and floats, not our enums: it crosses the wire as a plain tuple (see
        ``RequestMeta``).  Built once per request and compared with the cached one on every
        repeat, hence the tuple built directly rather than through the named tuple's
        keyword constructor.
        """
        kind = self.kind
        entries = self.entries
        tensors = ((entries[0].meta(kind),) if len(entries) == 1
                   else tuple([e.meta(kind) for e in entries]))
        return _new_meta((int(kind), int(self.op), float(self.prescale), float(self.postscale),
                          int(self.root), self.device, tensors, self.payload))

    @property
    def nbytes(self) -> int:
        return sum(e.input.nbytes for e in self.entries if e.input is not None)


# A request that stands in for a call refused at the call on this rank (bad arguments): it
# carries no tensor, only the refusal, so that the ranks that did submit the collective fail
# at once with this rank's reason instead of waiting for it (see collectives.requests).
_REFUSED = "refused"


def refusal(name: str, kind: Kind, set_id: int, message: str) -> Request:
    """The stand-in for a call of ``kind`` named ``name`` that this rank refused."""
    return Request(name=name, kind=kind, entries=[], process_set_id=set_id,
                   payload=(_REFUSED, message))


def refused_because(meta: RequestMeta) -> str | None:
    """The reason a rank gave when its call was refused, or None for a real request."""
    payload = meta.payload
    if isinstance(payload, (tuple, list)) and len(payload) == 2 and payload[0] == _REFUSED:
        return str(payload[1])
    return None


# Labels of RequestMeta's and EntryMeta's fields, in their order, for mismatch messages.
META_FIELDS = ("operation", "reduce op", "prescale factor", "postscale factor", "root rank",
               "device", "tensors", "arguments")
ENTRY_FIELDS = ("dtype", "number of dimensions", "shape")


def describe_mismatch(name: str, meta_a: RequestMeta, rank_a: int, meta_b: RequestMeta,
                      rank_b: int) -> str:
    """Explain the first difference between two ranks' metas, naming both values."""
    kind = Kind(meta_a.kind).label
    for field_name, a, b in zip(META_FIELDS, meta_a, meta_b):
        if a == b:
            continue
        if field_name == "operation":
            a, b = Kind(a).label, Kind(b).label
        elif field_name == "reduce op":
            a, b = ReduceOp(a).name.title(), ReduceOp(b).name.title()
        elif field_name == "tensors":
            return _describe_entries(name, kind, a, rank_a, b, rank_b)
        return (f"mismatched {field_name} for {kind} '{name}': rank {rank_a} has {a}, "
                f"rank {rank_b} has {b}")
    return f"mismatched arguments for {kind} '{name}' between ranks {rank_a} and {rank_b}"


def _describe_entries(name: str, kind: str, a: Sequence[EntryMeta], rank_a: int,
                      b: Sequence[EntryMeta], rank_b: int) -> str:
    if len(a) != len(b):
        return (f"mismatched number of tensors for grouped {kind} '{name}': rank {rank_a} has "
                f"{len(a)}, rank {rank_b} has {len(b)}")
    va: Any  # the fields of an EntryMeta differ in type
    vb: Any
    for i, (ea, eb) in enumerate(zip(a, b)):
        for field_name, va, vb in zip(ENTRY_FIELDS, ea, eb):
            if va != vb:
                where = f"tensor {i} of '{name}'" if len(a) > 1 else f"'{name}'"
                if field_name == "shape" and kind in ("allgather", "alltoall"):
                    field_name = "shape beyond the first dimension"
                if field_name == "shape":
                    va, vb = tuple(va), tuple(vb)
                return (f"mismatched {field_name} for {kind} {where}: rank {rank_a} has {va}, "
                        f"rank {rank_b} has {vb}")
    return f"mismatched tensors for {kind} '{name}'"


class Completion:
    """One condition variable for all handles: completing 1,000 at once wakes waiters once.

    It also keeps what the deadlock check needs to know about this process: how many threads
    are blocked in ``Handle.wait`` and when something last happened (a submission or a
    completion).
    """

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.waiters = 0
        self.last_activity = time.monotonic()
        # The engine's offer to run cycles on the waiting thread (engine.driver); None: wait.
        self.run_inline: Callable[[Handle], None] | None = None

    def touch(self) -> None:
        """Note activity (a submission): whatever waits may soon be able to proceed."""
        self.last_activity = time.monotonic()

    def idle_waiting_for(self) -> float:
        """Seconds since the last activity while some thread waits on a handle, else 0."""
        if self.waiters == 0:
            return 0.0
        return time.monotonic() - self.last_activity

    def finish(self, handles: Sequence[Handle]) -> None:
        callbacks: list[tuple[Callable[[Handle], None], Handle]] = []
        with self.cond:
            self.last_activity = time.monotonic()
            for h in handles:
                h._done = True
                if h._callbacks:
                    callbacks.extend((cb, h) for cb in h._callbacks)
                    h._callbacks = None
            self.cond.notify_all()
        # Outside the lock, on the finishing thread (usually the engine's): callbacks must be
        # quick and must not wait for other requests.
        for cb, h in callbacks:
            try:
                cb(h)
            except Exception as exc:  # noqa: BLE001 - a bad callback must not stop the engine
                sys.stderr.write(f"mpitrain: done-callback of '{h.request.name}' raised "
                                 f"{type(exc).__name__}: {exc}\n")


class Handle:
    """What an asynchronous call returns; pass it to ``poll`` or ``synchronize``."""

    __slots__ = ("_completion", "_done", "_error", "request", "result", "_finish", "_callbacks")

    def __init__(self, completion: Completion, request: Request) -> None:
        self._completion = completion
        self._done = False
        self._error: BaseException | None = None
        self.request = request
        self.result: Any = None
        # Set by the adapter: turns the completed request into what synchronize() returns.
        self._finish: Callable[[Handle], Any] | None = None
        self._callbacks: list[Callable[[Handle], None]] | None = None

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[Handle], None]) -> None:
        """Call ``callback(handle)`` once the request has finished (successfully or not).

        It runs on the thread that finishes the request (the engine's), or at once on this
        thread if that already happened; it must be quick, must not raise, and must not wait
        for another request (hand such work to a thread of your own).
        """
        with self._completion.cond:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback(self)

    def fail(self, error: BaseException) -> None:
        """Record an error (the handle is finished separately, in a batch)."""
        if self._error is None:
            self._error = error

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the request finished; return its result or raise its error.

        Raises:
            MpitrainInternalError: the collective failed on this or another rank.
            TimeoutError: ``timeout`` seconds passed first.
        """
        if not self._done:
            deadline = None if timeout is None else time.monotonic() + timeout
            completion = self._completion
            with completion.cond:
                completion.waiters += 1  # a waiter running cycles waits too (deadlock check)
            try:
                if completion.run_inline is not None and deadline is None:
                    completion.run_inline(self)
                with completion.cond:
                    while not self._done:
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            raise TimeoutError(
                                f"'{self.request.name}' did not finish in {timeout} s")
                        completion.cond.wait(remaining)
            finally:
                with completion.cond:
                    completion.waiters -= 1
        if self._error is not None:
            # A fresh error, so that the traceback shows this wait, of the same class as the
            # engine's (a mismatch stays a CollectiveMismatchError).
            if isinstance(self._error, CollectiveMismatchError):
                raise CollectiveMismatchError(str(self._error)) from self._error
            if isinstance(self._error, MpitrainInternalError):
                raise MpitrainInternalError(str(self._error)) from self._error
            raise self._error
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self.result = finish(self)
        return self.result
