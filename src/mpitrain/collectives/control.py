"""Collectives without data (barrier, join), the timeline, and what adapters ask about a
process set: everything an adapter needs from the engine besides moving tensors."""

from __future__ import annotations

from .. import session
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from ..engine.request import Handle, Kind, Request
from .requests import request_name, submit, wait_now


def barrier_async(process_set: ProcessSet = global_process_set,
                  name: str | None = None) -> Handle:
    """Start a barrier; the handle completes once every rank of the set has entered it."""
    set_id = set_id_of(process_set)
    request = Request(name=request_name(name, set_id, Kind.BARRIER), kind=Kind.BARRIER,
                      entries=[], process_set_id=set_id)
    return submit(request, None)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier()."""
    wait_now(barrier_async, process_set)


def join(device: int = -1, process_set: ProcessSet = global_process_set) -> int:
    """Declare that this rank has no more data; wait until every rank has joined.

    Meanwhile, allreduces submitted by the other ranks proceed with zeros from this rank
    (Average still divides by the full size).

    Returns:
        The rank that joined last.
    """
    del device  # accepted for Horovod compatibility; the engine needs no device here
    set_id = set_id_of(process_set)
    request = Request(name=request_name(None, set_id, Kind.JOIN), kind=Kind.JOIN, entries=[],
                      process_set_id=set_id)
    return int(wait_now(submit, request, None))


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (written by rank 0)."""
    session.engine().timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline and close its file (a valid JSON array)."""
    session.engine().timeline.stop()
