"""What elastic training keeps across a reset: the State interface and ObjectState.

A state is committed (copied to host memory, cheap and frequent) while training runs.  When a
collective fails, :func:`mpitrain.elastic.run` puts back the last commit on every survivor
(``restore``), rebuilds the job, and makes every rank equal to the new rank 0 (``sync``).
Framework states (``TorchState``) add handlers for models and optimizers on top of
:class:`ObjectState`, which carries plain Python values.

Where ranks cannot survive a death in place (an MPI without ULFM, or ``mpitrainrun
--elastic-restart``), the launcher restarts the whole job instead; then every commit is also
written by rank 0 to ``MPITRAIN_ELASTIC_STATE_FILE`` (atomically: a death mid-write leaves the
previous commit), as a :meth:`State.snapshot`, and the restarted job's :func:`mpitrain.elastic.run`
loads it on rank 0 before the first sync hands it to everyone.  Names and semantics are Horovod's
(``horovod.common.elastic``), so Horovod's elastic scripts run unchanged.
"""

from __future__ import annotations

import enum
import pickle
import queue
from collections.abc import Callable, Iterable
from typing import Any

from ..core import elastic_control, runtime
from ..core.errors import HostsUpdatedInterrupt
from ..face import files


class HostUpdateResult(enum.IntFlag):
    """What a host discovery reported: nothing, hosts removed, hosts added, or both."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class State:
    """Training state kept in memory on every rank and brought back after a reset.

    Args:
        bcast_object: ``f(obj) -> obj``, broadcasting a picklable object from rank 0 (every
            rank calls it; ``hvd.broadcast_object`` is the usual choice).
        get_rank: ``f() -> int``, this process's rank now (it changes across resets).
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        if not callable(bcast_object) or not callable(get_rank):
            raise TypeError(f"State(bcast_object={bcast_object!r}, get_rank={get_rank!r}): "
                            "both must be callables")
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Add functions called, in order, after every reset (e.g. to rescale the learning
        rate to the new ``size()``)."""
        callbacks = list(callbacks)
        bad = [c for c in callbacks if not callable(c)]
        if bad:
            raise TypeError(f"register_reset_callbacks: {bad!r} are not callable")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by :func:`run` once the job was rebuilt: ``reset()``, then the callbacks."""
        self._host_messages = queue.Queue()  # news from before the reset is stale
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult) -> None:
        """Note a host discovery's news; :meth:`check_host_updates` acts on it."""
        self._host_messages.put((timestamp, HostUpdateResult(update_res)))

    def commit(self) -> None:
        """Save the state to host memory, then check for host updates (every rank calls it,
        at the same point: the check is collective).

        Raises:
            HostsUpdatedInterrupt: hosts were added or removed; :func:`run` resets.
        """
        self.save()
        self._persist()
        self.check_host_updates()

    def _persist(self) -> None:
        """In restart mode, rank 0 writes the commit to the state file (see the module)."""
        if runtime.is_initialized() and runtime.state().config.elastic_commit_to_file:
            self.write_state_file()

    def write_state_file(self) -> None:
        """Rank 0 writes the last commit to the job's state file, if it has one (atomically)."""
        path = runtime.state().config.elastic_state_file if runtime.is_initialized() else ""
        if path and self._rank() == 0:
            files.write_atomic(path, pickle.dumps(self.snapshot(),
                                                  protocol=pickle.HIGHEST_PROTOCOL))

    def snapshot(self) -> Any:
        """The last commit as one picklable object (for restart mode's state file)."""
        raise NotImplementedError(f"{type(self).__name__} must implement snapshot() to run "
                                  "in restart mode")

    def load_snapshot(self, snapshot: Any) -> None:
        """Make :meth:`snapshot`'s object the last commit and restore it."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_snapshot() to "
                                  "run in restart mode")

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if rank 0 heard of new hosts.

        Collective: the news is broadcast from rank 0, so every rank raises at the same
        commit (or none does).
        """
        self._poll_driver()
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= result
        prev, last, update = self._bcast_object((prev, last, int(update)))
        self._last_updated_timestamp = last
        if last > prev:
            # Only removals: the survivors hold the same state already, no sync needed.
            raise HostsUpdatedInterrupt(HostUpdateResult(update) == HostUpdateResult.removed)

    def _poll_driver(self) -> None:
        """Rank 0, under ``mpitrainrun --host-discovery-script``: take the driver's latest
        notice (see :mod:`mpitrain.core.elastic_control`); the broadcast in
        :meth:`check_host_updates` hands it to every rank."""
        if not runtime.is_initialized() or self._rank() != 0:
            return
        directory = runtime.state().config.elastic_control_dir
        notice = elastic_control.read_notice(directory) if directory else None
        if notice is not None and notice[0] > self._last_updated_timestamp:
            self.on_hosts_updated(notice[0], HostUpdateResult(notice[1]))

    def save(self) -> None:
        """Copy the state to host memory."""
        raise NotImplementedError(f"{type(self).__name__} must implement save()")

    def restore(self) -> None:
        """Put back the last saved state, undoing what happened since."""
        raise NotImplementedError(f"{type(self).__name__} must implement restore()")

    def sync(self) -> None:
        """Make every rank's state equal to rank 0's (collective)."""
        raise NotImplementedError(f"{type(self).__name__} must implement sync()")

    def reset(self) -> None:
        """Adjust to a rebuilt job, before the state is synchronised (nothing by default)."""


class ObjectState(State):
    """State made of picklable Python values, given as keyword arguments and kept as
    attributes (``state.epoch``, ``state.batch``).

    Args:
        bcast_object: broadcasts an object from rank 0 (see :class:`State`).
        get_rank: returns this process's rank.
        **kwargs: the values to track; each becomes an attribute of the state.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        # What is broadcast is the last saved state (as in Horovod): after a failure, every
        # survivor has restored it, and a newcomer gets it from rank 0.
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def snapshot(self) -> Any:
        return {"values": dict(self._saved_state)}

    def load_snapshot(self, snapshot: Any) -> None:
        self._saved_state = dict(snapshot["values"])
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


__all__ = ["HostUpdateResult", "ObjectState", "State"]
