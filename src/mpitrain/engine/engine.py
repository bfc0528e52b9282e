"""The background engine: one thread owns all communication of this process.

Callers submit named requests and get handles back at once.  The thread runs cycles; a cycle
is one negotiation round per process set this rank belongs to, in set-id order, each followed
by the execution of what that round decided.  Because every member runs the same rounds in the
same order, collectives match across ranks without any further coordination.

The thread never spins: between cycles it sleeps on a condition variable that a submission
wakes, for the cycle time while work is pending here (or in some rank's smaller set) and for a
growing idle interval otherwise.  A thread waiting on a handle while no cycle runs runs the
cycles itself (:mod:`.driver`).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ..core import survivors, topology
from ..core.config import Config
from ..core.errors import CollectiveMismatchError, MpitrainInternalError, ranks_text
from ..ops.kernels import cpu
from . import autotune_sync, buckets
from .autotune import Setting, start_setting
from .driver import CycleDriver
from .negotiation import Response
from .request import Completion, Handle, Kind, Request
from .set_registry import GLOBAL_SET_ID, SetRegistry
from .set_state import SetState
from .timeline import Timeline


class Engine:
    def __init__(self, config: Config, topo: topology.Topology,
                 comms: topology.Communicators) -> None:
        self.config = config
        self.topology = topo
        self.completion = Completion()
        self.timeline = Timeline(enabled_here=topo.rank == 0)
        if config.timeline:
            self.timeline.start(config.timeline, config.timeline_mark_cycles)
        self._cond = threading.Condition(threading.Lock())
        self._inbox: list[Request] = []
        # Run by the executor now (neither queued nor pending): failed here if it raises.
        self._executing: list[Request] = []
        self._stopping = False
        self._stopped = False
        self._stop_reason = ""
        self._stopping_ranks: list[int] = []
        self._leaving = False  # this rank stops to leave the job (see stop())
        self._peers_left: list[int] = []
        self._driver = CycleDriver(self.run_cycle, self._cond, lambda: len(self._inbox),
                                   lambda: self._stopping, lambda: self.cycle_time_s)
        self.completion.run_inline = self._driver.run_until_done
        self._sets = SetRegistry(self._cond, config, self.timeline, topo,
                                 lambda: self.fusion_threshold)
        self.cycle_time_s = config.cycle_time_ms / 1e3  # autotune may change it
        self.autotune = autotune_sync.AutotuneSync.for_job(config, topo.rank, topo.size,
                                                           topo.num_nodes)
        self._sets.open(GLOBAL_SET_ID, list(range(topo.size)), comms, topo,
                        self.autotune.setting, autotune_sync.WORDS)

    # ------------------------------------------------------------------ process sets
    def process_set(self, set_id: int) -> SetState:
        return self._sets.get(set_id)

    def set_ids(self) -> list[int]:
        return self._sets.ids()

    # ------------------------------------------------------------------ gradient buckets
    @property
    def fusion_threshold(self) -> int:
        """The fusion threshold now (autotune's last setting, else the configuration's): every
        executor fuses and buckets are planned at it; all ranks change it in one cycle."""
        setting = self.autotune.setting
        return self.config.fusion_threshold if setting is None else setting.fusion_threshold

    def plan_buckets(self, items: Sequence[tuple[Hashable, int]],
                     cap_bytes: int | None = None,
                     first_cap_bytes: int | None = buckets.FIRST_BUCKET_BYTES
                     ) -> list[list[int]]:
        """Group (key, nbytes) items into gradient buckets (see :mod:`.buckets`).

        The cap is the current fusion threshold unless the caller names one (DDP's
        ``bucket_cap_mb``); ``first_cap_bytes=None`` caps the first bucket like the others.
        A plan is identical on every rank when the ranks plan at the same threshold: the
        configured one until autotune changes it, so plan before training starts (as
        optimizers and DDP do at construction) or once autotune has frozen.
        """
        cap = self.fusion_threshold if cap_bytes is None else cap_bytes
        return buckets.plan(items, cap, first_cap_bytes)

    def bucket_memory(self, set_id: int, nbytes: int) -> np.ndarray:
        """A zeroed byte buffer for a gradient bucket of ``set_id``, from the memory the data
        plane reduces from fastest.  Not collective.

        Raises:
            ValueError: this rank is not a member of the set.
        """
        group = self.process_set(set_id).group
        if group is None:
            raise ValueError(f"this rank is not a member of process set {set_id}; it has no "
                             "gradient buckets there")
        memory = group.shared_empty(nbytes)
        memory[:] = 0
        return memory

    # ------------------------------------------------------------------ submission
    def start(self) -> None:
        cpu.warm_up_in_background()  # the first allreduce need not wait for numba's load
        self._driver.start()

    def next_name(self, set_id: int, kind: Kind) -> str:
        """A name for an unnamed request: identical programs produce identical names."""
        return self._sets.next_name(set_id, kind)

    def submit(self, request: Request, wake: bool = True) -> Handle:
        """Queue ``request`` for negotiation and return its handle.

        ``wake=False``: the caller waits for the handle at once and runs the cycles itself
        (:mod:`.driver`), so the engine thread is left asleep.

        Raises:
            ValueError: a request of the same name is still in flight, or this rank is not
                a member of the request's process set.
            MpitrainInternalError: the engine has stopped.
        """
        handle = Handle(self.completion, request)
        request.handle = handle
        with self._cond:
            if self._stopped or self._stopping:
                raise MpitrainInternalError(self._stop_reason or "mpitrain has been shut down; "
                                            "call mpitrain.init() again to use it")
            state = self._sets.states.get(request.process_set_id)
            if state is None:
                raise ValueError(f"process set {request.process_set_id} is not registered")
            if not state.member:
                raise ValueError(f"rank {self.topology.rank} is not a member of process set "
                                 f"{request.process_set_id} (ranks {state.world_ranks})")
            names = self._sets.inflight[request.process_set_id]
            if request.name in names:
                raise ValueError(f"a request named '{request.name}' is already in flight; "
                                 "names must be unique until synchronized")
            names.add(request.name)
            if request.device != "cpu":
                self._driver.inline_allowed = False  # see .driver: CUDA stays on the thread
            self._inbox.append(request)
            self.completion.touch()
            if len(self._inbox) == 1 and (wake or not self._driver.inline_allowed):
                self._cond.notify()
        return handle

    def stop(self, leaving: bool = False) -> None:
        """Stop the thread; every rank's pending requests fail; returns when it has ended.

        ``leaving``: this rank leaves the job (shutdown(), the end of its program) rather than
        stopping to rebuild it with the others: ranks that go on learn it
        (:attr:`peers_left`) and can rebuild without this one.
        """
        with self._cond:
            thread = self._driver.thread
            if thread is None:
                self._stopped = True
                return
            self._leaving = leaving
            self._stopping = True
            self._cond.notify()
        thread.join()
        self.timeline.stop()
        self.autotune.close()
        for state in self._sets.states.values():
            state.close()

    @property
    def peers_left(self) -> list[int]:
        """The other ranks whose leaving the job (``stop(leaving=True)``) stopped this engine
        while this rank did not ask to stop (empty if it stopped for any other reason)."""
        return list(self._peers_left)

    def abandon(self) -> None:
        """Stop without the other ranks taking part: revoke every communicator first, so
        that this thread's collectives (and the peers') fail instead of waiting for ranks
        that will never join, then stop."""
        self._revoke_all()
        self.stop()

    def _revoke_all(self) -> None:
        """Interrupt this engine's collectives here and at the peers (with ULFM; without,
        mpirun ends the job when a rank dies anyway)."""
        with self._cond:
            sets = list(self._sets.states.values())
        survivors.revoke(comm for state in sets for comm in state.communicators())

    # ------------------------------------------------------------------ the thread
    def run_cycle(self) -> bool:
        """One cycle, on whichever thread holds the driver's lock; False once the engine has
        ended (some rank stopped it, or it failed here: then everything pending fails)."""
        self.timeline.cycle(time.monotonic())
        try:
            stop = self._cycle()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter
            self._revoke_all()  # a peer may wait in a collective this rank will never join
            sys.stderr.write(f"mpitrain: rank {self.topology.rank}: engine failed: "
                             f"{type(exc).__name__}: {exc}\n")
            self._finish_all(f"mpitrain engine failed on rank {self.topology.rank}: "
                             f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, Exception) and \
                    threading.current_thread() is not self._driver.thread:
                raise  # a KeyboardInterrupt in a waiter's cycle reaches its program
            return False
        if stop:
            self._finish_all(self._stop_reason or _stopped_by(self._stopping_ranks))
            return False
        return True

    def _cycle(self) -> bool:
        """One round for every set this rank is in; returns whether to stop."""
        with self._cond:
            inbox, self._inbox = self._inbox, []
            stopping = self._stopping
            sets = [self._sets.states[i] for i in sorted(self._sets.states)]
        for request in inbox:
            state = self._sets.states.get(request.process_set_id)
            if state is None or state.negotiator is None:
                self._fail_now([request], f"process set {request.process_set_id} was removed")
                continue
            state.negotiator.add(request)
        pending_elsewhere = False
        deadlock_s = self.config.deadlock_time_seconds
        stuck = deadlock_s > 0 and self.completion.idle_waiting_for() >= deadlock_s
        # Work pending in a smaller set needs every cycle's global round from all ranks.
        elsewhere = any(s.negotiator.pending for s in sets
                        if s.id != GLOBAL_SET_ID and s.negotiator is not None)
        for state in sets:
            if state.negotiator is None or state.id not in self._sets.states:
                continue
            is_global = state.id == GLOBAL_SET_ID
            result = state.negotiator.round(stopping, stuck, self.autotune.outgoing()
                                            if is_global else None, self._leaving,
                                            is_global and elsewhere)
            if is_global and result.extra is not None:
                setting = self.autotune.incoming(result.extra)
                if setting is not None:
                    self._apply(setting)
            pending_elsewhere |= result.pending_elsewhere
            if result.gave_up:
                # Requests failed because some rank never submitted them: the ranks have
                # drawn different numbers of unnamed names (one called a collective the
                # others did not, or by name where they did not), and every later unnamed
                # collective would pair with another rank's earlier one.  Once nothing is
                # pending anywhere (nobody is ahead with work still to pair), take the
                # largest count everywhere, so the next unnamed collective pairs up again.
                # Before the failed handles complete: their waiters must not name anything
                # until the counts agree.
                self._sets.align_names(state, only_if_quiet=True)
            self._execute(state, result.responses)
            if result.someone_stopping and is_global:
                self._stopping_ranks = result.leaving_ranks or result.stopping_ranks
                if not stopping:  # others stopped this engine; this rank may go on
                    self._peers_left = result.leaving_ranks
                return True
        # The cycle time only while rounds can decide something (work pending here or in a
        # smaller set): an idle rank's round would pair with another's round for its next
        # request, which then takes two (docs/performance.md, "Rounds that decide nothing").
        self._driver.someone_pending = pending_elsewhere or any(
            s.negotiator is not None and s.negotiator.pending for s in sets)
        return False

    def _apply(self, setting: Setting) -> None:
        """Run with autotune's ``setting`` from now on (every rank, in the same round)."""
        self.cycle_time_s = setting.cycle_time_ms / 1e3
        for state in self._sets.states.values():
            state.apply(setting)

    def _execute(self, state: SetState, responses: list[Response]) -> None:
        assert state.executor is not None and state.negotiator is not None
        data: list[Response] = []
        done: list[Response] = []
        for resp in responses:
            kind = resp.kind
            if resp.error is not None:
                if resp.request is not None and resp.request.handle is not None:
                    error_type = CollectiveMismatchError if resp.mismatch else \
                        MpitrainInternalError
                    resp.request.handle.fail(error_type(resp.error))
                done.append(resp)
            elif kind == Kind.JOIN:
                self._sets.align_names(state)
                if resp.request is not None:
                    resp.request.entries = []
                    if resp.request.handle is not None:
                        resp.request.handle.result = state.world_ranks[resp.last_joined]
                done.append(resp)
            elif kind == Kind.ADD_SET or kind == Kind.REMOVE_SET:
                self._sets.control(resp, self.autotune.setting, self._fail_now)
                done.append(resp)
            else:
                data.append(resp)
        if data:
            self._executing = [resp.request for resp in data if resp.request is not None]
            if self.autotune.measuring:
                self.autotune.record(state.id, data)
            state.executor.run(data)
            self._executing = []
            for resp in data:
                state.negotiator.remember(resp)
        self._complete(state, done + data)

    def _complete(self, state: SetState, responses: list[Response]) -> None:
        handles = []
        with self._cond:
            names = self._sets.inflight.get(state.id, set())
            for resp in responses:
                request = resp.request
                if request is None:
                    continue
                names.discard(request.name)
                if request.handle is not None:
                    handles.append(_released(request))
        if handles:
            self.completion.finish(handles)

    def _fail_now(self, requests: list[Request], message: str) -> None:
        handles = []
        with self._cond:
            for request in requests:
                self._sets.inflight.get(request.process_set_id, set()).discard(request.name)
                if request.handle is not None:
                    request.handle.fail(MpitrainInternalError(
                        f"{request.kind.label} '{request.name}': {message}"))
                    handles.append(_released(request))
        self.completion.finish(handles)

    def _finish_all(self, message: str) -> None:
        """Fail everything still queued or pending, and refuse new submissions."""
        with self._cond:
            self._stopped = True
            self._stop_reason = message
            leftovers = self._inbox + self._executing
            self._inbox, self._executing = [], []
            self._cond.notify_all()  # an engine thread asleep ends now (see .driver)
        for state in list(self._sets.states.values()):
            if state.negotiator is not None:
                leftovers.extend(state.negotiator.drop_all())
        self._fail_now(leftovers, message)

    # ------------------------------------------------------------------ introspection
    def tuned(self) -> dict[str, Any]:
        """What autotune has this rank running now (the configuration's until rank 0 sends
        a setting; then the setting's), and whether it is frozen."""
        setting = self.autotune.setting or start_setting(self.config)
        return {**setting._asdict(), "frozen": self.autotune.frozen,
                "changes": self.autotune.changes,
                "generation": self.autotune.applied_generation}

    def stats(self) -> dict[str, Any]:
        """Counters for tests and benchmarks (global set)."""
        state = self._sets.states[GLOBAL_SET_ID]
        assert state.negotiator is not None and state.executor is not None
        return {
            "cycles": self._driver.cycles,
            "inline_cycles": self._driver.inline_cycles,
            "rounds": state.negotiator.rounds,
            "announcement_rounds": state.negotiator.announcement_rounds,
            "collectives": state.executor.collectives,
            "rode_in_round": state.negotiator.wire.rode,
            "fused_tensors": state.executor.fused_tensors,
            "zero_copy_buckets": state.executor.zero_copy_buckets,
            "cached": len(state.negotiator.cache),
        }


def _stopped_by(ranks: list[int]) -> str:
    """Why requests fail once some rank shut down (its program ended, or it called shutdown())."""
    who = ranks_text(ranks) if ranks else "some rank"
    return (f"mpitrain was shut down on {who} (shutdown() was called there, or its program "
            "ended) while this request was in flight")


def _released(request: Request) -> Handle:
    """``request``'s handle, which no longer points back at it.

    A handle and its request referred to each other, and the entries hold the caller's
    tensors: a cycle only the cyclic collector frees, rarely (with PowerSGD on 2 x
    Linear(2048, 2048) 32 MiB more heap per step, 40-60 ms of page faults now and then).
    The handle keeps the request (its name for messages), not its host entries: a handle
    held after ``synchronize`` keeps 4 objects for the collector to examine, not 7
    (:mod:`mpitrain.core.collector`).  CUDA entries stay: the streams may still read them.
    """
    handle = request.handle
    assert handle is not None
    request.handle = None
    if request.device == "cpu":
        request.entries = []
    return handle
