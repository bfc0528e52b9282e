"""Channels: a bucket split across N CUDA streams, each with its own communicator and thread.

Ordering, which is the whole point (``MPITRAIN_ALLREDUCE_STREAMS=N``):

* **Before**: every channel stream waits on an event recorded on the framework's stream when
  the tensors were submitted, so no kernel reads a gradient before the backward pass that
  writes it has run on the device, whatever the host thread did meanwhile.
* **Within** a channel: its kernels run in order on its stream; before handing device memory
  to MPI (which knows nothing of streams) the channel's host thread waits for its stream.
* **After**: the framework's stream waits on an event recorded at the end of every channel,
  so anything the framework enqueues later (``optimizer.step()``) sees the results, while the
  host never blocks on the whole device.

The split is a pure function of the element count, so every rank cuts a bucket the same way
and channel c carries the same slice everywhere, in the same order on its communicator.
The device API is behind :class:`StreamBackend` so the tests drive the same code on a fake
device that executes streams in an adversarial order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from ..slices import balanced

MIN_CHUNK_BYTES = 1 << 20  # below this a channel's fixed costs outweigh the parallelism


class StreamBackend(Protocol):
    """The few stream/event operations channels need (cupy on a GPU, fakes in tests)."""

    def new_stream(self) -> Any: ...

    def record(self, stream: Any) -> Any:
        """Record and return a new event on ``stream``."""

    def wait(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event`` (the host does not block)."""

    def synchronize(self, stream: Any) -> None:
        """Block the host until ``stream`` has finished all work enqueued so far."""

    def host_wait(self, event: Any) -> None:
        """Block the host until ``event`` has happened."""


def split(count: int, channels: int, align: int = 1, min_chunk: int = 1) -> list[tuple[int, int]]:
    """Cut ``count`` elements into at most ``channels`` contiguous slices, in order.

    Slices start at multiples of ``align`` (so vector kernels stay aligned), are at least
    ``min_chunk`` elements long except when the whole bucket is shorter, and differ in length
    by at most ``align``.  A pure function of its arguments: every rank cuts the same way.

    Raises:
        ValueError: a non-positive ``channels``, ``align`` or ``min_chunk``, or negative count.
    """
    for name, value in (("channels", channels), ("align", align), ("min_chunk", min_chunk)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    if count == 0:
        return []
    units = (count + align - 1) // align
    n = max(1, min(channels, units, count // min_chunk if count >= min_chunk else 1))
    return balanced(count, n, align)


@dataclass(frozen=True)
class Slicing:
    """How a run cuts its elements among the channels (see :func:`split`)."""

    align: int = 1
    min_chunk: int = 1


_WHOLE_ELEMENTS = Slicing()


@dataclass
class Channel:
    """One lane: a stream, a communicator no other lane uses, and a host thread."""

    index: int
    stream: Any
    comm: Any


Work = Callable[[Channel, int, int], None]


class Channels:
    """N channels over one device; runs a bucket's slices on them in parallel.

    Channel 0 runs on the caller's thread (no hand-off when N is 1); the others each on a
    dedicated thread, so the calls on each channel's communicator happen in the same order on
    every rank.
    """

    def __init__(self, backend: StreamBackend, comms: Sequence[Any]) -> None:
        if not comms:
            raise ValueError("Channels needs at least one communicator")
        self.backend = backend
        self.channels = [Channel(i, backend.new_stream(), comm) for i, comm in enumerate(comms)]
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"mpitrain-channel-{i}")
                         for i in range(1, len(comms))]

    def __len__(self) -> int:
        return len(self.channels)

    def run(self, framework_stream: Any, ready: Any, count: int, work: Work,
            slicing: Slicing = _WHOLE_ELEMENTS, join: Sequence[Any] | None = None) -> list[Any]:
        """Run ``work(channel, start, stop)`` for each slice of ``count`` elements.

        A channel whose stream is the framework's own (channel 0's stream, when the caller
        packs on it) neither waits for ``ready`` nor is waited for by that stream: the stream's
        order already serialises it, and each such event would be a driver call for nothing.

        Args:
            framework_stream: the stream the tensors' producer and consumer run on.
            ready: an event recorded on it after the tensors were written, or None to record
                one now (only if some channel runs on another stream).
            work: enqueues the slice's kernels on ``channel.stream`` and does its
                communication on ``channel.comm``.
            slicing: how the ``count`` elements are cut among the channels.
            join: the streams made to wait for every channel (default: the framework's).

        Returns:
            The channels' end events, which the ``join`` streams have been made to wait on
            (None for a channel on the one join stream that is its own).

        Raises:
            The first exception a slice raised, after every slice has finished.
        """
        slices = split(count, len(self.channels), slicing.align, slicing.min_chunk)
        lanes = self.channels[:len(slices)]
        if ready is None and any(c.stream is not framework_stream for c in lanes):
            ready = self.backend.record(framework_stream)
        joins = [framework_stream] if join is None else list(join)
        futures: list[Future[Any]] = []
        for c, (start, stop) in enumerate(slices[1:], start=1):
            futures.append(self._threads[c - 1].submit(
                self._lane, self.channels[c], (framework_stream, ready, joins), work, start,
                stop))
        errors: list[BaseException] = []
        done: list[Any] = []
        if slices:
            try:
                done.append(self._lane(self.channels[0], (framework_stream, ready, joins), work,
                                       *slices[0]))
            except BaseException as exc:  # noqa: BLE001 - reported after the others finish
                errors.append(exc)
        for future in futures:
            try:
                done.append(future.result())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]
        for stream in joins:
            for channel, event in zip(lanes, done):
                if event is not None and channel.stream is not stream:
                    self.backend.wait(stream, event)
        return done

    def _lane(self, channel: Channel, order: tuple[Any, Any, list[Any]], work: Work, start: int,
              stop: int) -> Any:
        framework_stream, ready, joins = order
        if channel.stream is not framework_stream:
            self.backend.wait(channel.stream, ready)
        work(channel, start, stop)
        if all(stream is channel.stream for stream in joins):
            return None  # its only joiner is its own stream: nothing to record
        return self.backend.record(channel.stream)

    def close(self) -> None:
        for pool in self._threads:
            pool.shutdown(wait=True)
        for channel in self.channels:
            free = getattr(channel.comm, "Free", None)
            if free is not None:
                free()


class CupyStreams:
    """:class:`StreamBackend` over cupy streams and events."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def new_stream(self) -> Any:
        return self.cupy.cuda.Stream(non_blocking=True)

    def record(self, stream: Any) -> Any:
        event = self.cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def external(self, pointer: int) -> Any:
        """A cupy view of a stream another framework owns (torch's current stream)."""
        return self.cupy.cuda.ExternalStream(pointer)
