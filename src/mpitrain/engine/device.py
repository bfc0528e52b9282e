"""The engine's door to the GPU data plane (:mod:`mpitrain.ops.cuda`).

Requests carry a device kind, ``cpu`` or ``cuda``, that negotiation compares across ranks
(a rank with CPU tensors and one with CUDA tensors under one name is a mismatch, reported on
every rank).  The executor sends CUDA allreduce buckets here; other CUDA collectives
(broadcast, allgather, alltoall, reducescatter: parameters, statistics, rarely large) are
staged through host memory around the CPU data plane.  Nothing here imports cupy until a CUDA
request actually runs, so CPU-only jobs never touch it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.dtypes import STORAGE, ReduceOp
from ..ops import allreduce as host_allreduce
from ..ops.cuda import available, require
from ..ops.group import Group
from ..ops.reduction import Reduction
from .request import RequestMeta

CPU = "cpu"
CUDA = "cuda"


def is_cuda(meta: RequestMeta) -> bool:
    """Whether a negotiated request runs on CUDA buffers."""
    return bool(meta.device == CUDA)


@functools.cache
def cuda_awareness(setting: str) -> Any:
    """Whether this process's MPI takes device pointers; detected once per process."""
    from mpi4py import MPI  # importing mpi4py.MPI initialises MPI: only once init() runs

    from ..ops.cuda import transport  # loads the CUDA transports: only for a GPU job
    return transport.detect(setting, MPI.Get_library_version())


def cuda_available() -> bool:
    """Whether the GPU data plane can run here (cupy importable and a GPU visible)."""
    return available()


def require_cupy(what: str) -> Any:
    """cupy, or :class:`mpitrain.ops.cuda.CudaUnavailableError` naming ``what`` needed it."""
    return require(what)


class ReadyMark(NamedTuple):
    """An event recorded on a framework stream when a request was submitted.

    ``order`` numbers every mark of this process in the order they were recorded: of two marks
    on one stream, the later one's event completes only after the earlier one's, so waiting
    for the latest mark of each stream is waiting for all of them.
    """

    event: Any
    stream: Any
    pointer: int
    order: int


_marks = itertools.count()
_marking = threading.Lock()


@functools.lru_cache(maxsize=64)
def _external_stream(pointer: int) -> Any:
    """One cupy view per framework stream, made once (one process drives one GPU): the same
    object each time, so a bucket's requests on one stream are seen to share it."""
    cupy = require("a collective on CUDA tensors")
    return cupy.cuda.Stream.null if pointer == 0 else cupy.cuda.ExternalStream(pointer)


def mark_ready(stream_pointers: Sequence[int]) -> list[ReadyMark]:
    """Record an event on each framework stream, now, on the submitting thread.

    The device allreduce waits for these before reading the tensors (so it never reads a
    gradient the backward pass has not written yet) and makes the same streams wait for its
    results.  Returns one mark per distinct stream.
    """
    cupy = require("a collective on CUDA tensors")
    marks = []
    for pointer in dict.fromkeys(stream_pointers):
        stream = _external_stream(int(pointer))
        event = cupy.cuda.Event(block=False, disable_timing=True)
        with _marking:  # the number says when the record was enqueued, among all threads
            event.record(stream)
            marks.append(ReadyMark(event, stream, int(pointer), next(_marks)))
    return marks


def latest_marks(requests: Sequence[Any]) -> list[ReadyMark]:
    """The last mark of each framework stream among ``requests``' (one wait per stream, not
    one per request: a bucket of hundreds of gradients waits on as many streams as it has)."""
    latest: dict[int, ReadyMark] = {}
    for request in requests:
        for mark in (getattr(request, "ready", None) or ()):
            seen = latest.get(mark.pointer)
            if seen is None or mark.order > seen.order:
                latest[mark.pointer] = mark
    return list(latest.values())


def to_device(array: Any) -> Any:
    """A cupy view of a device array; a host array (a joined rank's zeros) is uploaded."""
    cupy = require("a collective on CUDA tensors")
    if isinstance(array, cupy.ndarray):  # the engine's entries already are: no new object
        return array
    if hasattr(array, "__cuda_array_interface__"):
        return cupy.asarray(array)
    uploaded = cupy.asarray(array)
    # Uploaded on this thread's current stream; the data plane reads it on its own streams,
    # which are not ordered after that one: wait for the copy to land.
    cupy.cuda.get_current_stream().synchronize()
    return uploaded


def to_host(array: Any) -> np.ndarray:
    cupy = require("a collective on CUDA tensors")
    return np.ascontiguousarray(cupy.asnumpy(array))


class DeviceLayer:
    """The CUDA side of one process set's executor, created lazily."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._device_group: Any = None

    def _dg(self, arrays: Sequence[Any]) -> Any:
        if self._device_group is None:
            from ..ops.cuda.allreduce import DeviceGroup  # CUDA kernels: on the first GPU request
            aware = cuda_awareness(self.group.config.cuda_aware_mpi)
            # The GPU of this rank's tensors (a joined rank, with none, keeps the current one).
            device = next((int(a.device.id) for a in arrays
                           if hasattr(a, "__cuda_array_interface__")), None)
            self._device_group = DeviceGroup(self.group, aware.supported, device=device)
        return self._device_group

    def allreduce(self, inputs: Sequence[Any], outputs: Sequence[Any],
                  requests: Sequence[Any], how: Reduction) -> None:
        """Allreduce a bucket of flat device arrays, ordered after its requests' events."""
        if how.op == ReduceOp.ADASUM:
            self._adasum_staged(inputs, outputs, requests, how)
            return
        marks = latest_marks(requests)
        ready = [mark.event for mark in marks]
        streams = [mark.stream for mark in marks]
        if not streams:  # a joined rank: no framework stream of its own to order against
            streams = [require("a collective on CUDA tensors").cuda.get_current_stream()]
        dg = self._dg(inputs)
        with dg.on_device():  # a joined rank's zeros are uploaded to this rank's GPU
            # The engine's entries are cupy arrays already: no call per tensor for them.
            kind = dg.cupy.ndarray
            dg.allreduce([x if type(x) is kind else to_device(x) for x in inputs],
                         [x if type(x) is kind else to_device(x) for x in outputs],
                         how, ready, streams)

    def _adasum_staged(self, inputs: Sequence[Any], outputs: Sequence[Any],
                       requests: Sequence[Any], how: Reduction) -> None:
        """Adasum of device arrays on host copies (no device kernels for it, as in Horovod
        built without NCCL): packed on the host, reduced by the CPU data plane, copied back."""
        for mark in latest_marks(requests):
            mark.event.synchronize()  # the producer's writes, before the download
        hosts = [to_host(x).reshape(-1) for x in inputs]
        counts = [h.size for h in hosts]
        fused = np.concatenate(hosts) if hosts else np.empty(0, dtype=STORAGE[how.dtype])
        host_allreduce(self.group, fused, fused, how, counts=counts)
        offset = 0
        for out, n in zip(outputs, counts):
            to_device(out).set(fused[offset:offset + n].reshape(out.shape))
            offset += n

    @contextlib.contextmanager
    def staged(self, entries: Sequence[Any]) -> Iterator[None]:
        """Run a CPU collective on host copies of CUDA entries, then copy results back.

        Inputs are downloaded after their framework streams' work (``cupy.asnumpy`` waits
        for the current stream; the submit-time events order it after the producer);
        outputs allocated by the collective are created on the device from the host result.
        """
        saved = []
        for e in entries:
            device_out, device_alloc = e.output, e.allocate
            shapes: list[tuple[int, ...]] = []
            if e.input is not None:
                e.input = to_host(e.input).reshape(e.input.shape)
            if device_out is not None:
                e.output = to_host(device_out).reshape(device_out.shape)
            if device_alloc is not None:
                def host_alloc(shape: tuple[int, ...], _dtype: str = e.dtype,
                               _shapes: list[tuple[int, ...]] = shapes) -> np.ndarray:
                    _shapes.append(tuple(shape))
                    return np.empty(shape, dtype=STORAGE[_dtype])
                e.allocate = host_alloc
            saved.append((e, device_out, device_alloc, shapes))
        yield
        for e, device_out, device_alloc, shapes in saved:
            host_out = e.output
            if device_out is not None:
                to_device(device_out).set(host_out)  # copies onto the array's own GPU
                e.output = device_out
            elif device_alloc is not None and shapes:
                out = device_alloc(shapes[-1])
                to_device(out).set(host_out)
                e.output = out
            e.allocate = device_alloc

    def close(self) -> None:
        if self._device_group is not None:
            self._device_group.close()
            self._device_group = None
