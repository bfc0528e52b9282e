"""Negotiation: agree, every cycle, which requests all ranks of a process set have submitted.

One round per cycle per process set, on a communicator used for nothing else:

1. **Header** (one non-blocking AND-allreduce of a few words): the cache bits of this rank's
   pending repeats (AND: ready everywhere), stale cache bits (OR), and flags (OR: someone has
   new requests to announce / is stopping / has work pending in another set / suspects a
   stall).  OR values travel inverted so one AND-reduction carries both.  In steady-state
   training this is the whole exchange: a few hundred bytes however many tensors there are.
2. **Announcements**, only when someone has new names: every rank's new (name, meta) pairs are
   all-gathered.  Every rank applies them to an identical table, so all ranks take the same
   decisions without a coordinator.
3. **Decisions**: cached bits set everywhere, then table entries every (non-joined) rank has
   announced, in announcement order.  Mismatched metas become errors, on every rank at once.

Joined ranks (``join()``) set every cache bit and count as having announced everything, so the
others' allreduces proceed with zeros from them.

The header's last word is AND-reduced as it is: 1 where this rank is *stuck* (requests pending
here, a thread blocked waiting on one, and nothing submitted or completed in this process for
the deadlock time).  When it comes back 1, every rank is stuck in the same round and nothing
can change any more (no rank will submit, no pending request can match): every rank fails its
pending requests with one message that says which rank submitted which tensor, instead of
waiting for a human.  What is missing where, and the words of these reports, are in
:mod:`.stalls`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.config import Config
from ..core.errors import ranks_text
from .cache import ResponseCache
from .header import Header, RoundWire
from .mpi_wait import wait_for
from .request import Kind, Request, RequestMeta, describe_mismatch, refused_because
from .stalls import StallInspector, gather_pending

# Flags carried in the OR word of the header.
F_ANNOUNCE = 1
F_STOP = 2
F_ELSEWHERE = 4
F_STALL = 8
F_JOINED = 16

UNCACHED_KINDS = (Kind.JOIN, Kind.ADD_SET, Kind.REMOVE_SET)
# Kind(value) goes through Enum.__call__ (~0.5 us); the engine asks a response's kind several
# times per tensor, so a plain dict lookup keeps it off the per-op budget.
_KIND_OF = {int(k): k for k in Kind}


@dataclass
class Response:
    """A decision of one round, identical on every rank of the set."""

    name: str
    meta: RequestMeta
    request: Request | None  # None on a joined rank that did not submit it
    error: str | None = None
    # The error is the ranks' disagreement about the request (its arguments, or it cannot
    # run beside join()), not a failure of the job: see errors.CollectiveMismatchError.
    mismatch: bool = False
    joined: frozenset[int] = frozenset()
    from_table: bool = False
    last_joined: int = -1
    reduced: np.ndarray | None = None  # a small allreduce's result, computed in the round
    decided_at: float = field(default_factory=time.monotonic)

    @property
    def kind(self) -> Kind:
        return _KIND_OF[self.meta.kind]


@dataclass
class RoundResult:
    responses: list[Response]
    someone_stopping: bool
    # Some rank has requests pending in another process set: its cycles run this set's
    # rounds too, which pair with every member's (see Engine._cycle).
    pending_elsewhere: bool
    extra: np.ndarray | None = None  # the header's extra words, AND-reduced
    stopping_ranks: list[int] = field(default_factory=list)  # world ranks, when someone stops
    leaving_ranks: list[int] = field(default_factory=list)  # those of them that leave the job
    # Requests were failed in this round because some rank never submitted them (a deadlock
    # broken, a stall given up on): the same on every rank of the set.
    gave_up: bool = False


class Negotiator:
    """The negotiation state of one process set on this rank (used by the engine thread only)."""

    def __init__(self, comm: Any, world_ranks: list[int], config: Config,
                 extra_words: int = 0) -> None:
        """``config`` gives the response cache's capacity and the stall limits."""
        self.comm = comm
        self.extra_words = extra_words
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.world_ranks = world_ranks
        self.cache = ResponseCache(config.cache_capacity)
        self.pending: dict[str, Request] = {}
        self.unannounced: list[Request] = []
        self.hits: dict[int, Request] = {}  # cache bit -> pending repeat
        self.stale: set[int] = set()
        self.table: dict[str, dict[int, RequestMeta]] = {}
        self.joined: list[int] = []  # ranks of the set, in the order they joined
        self.stalls = StallInspector.for_config(self.rank, config)
        # The deterministic designs define a reduction's bits: nothing rides there.
        self.wire = RoundWire(comm, self.cache, extra_words,
                              0 if config.deterministic else config.round_ride_bytes)
        self.rounds = 0
        self.announcement_rounds = 0

    # ----------------------------------------------------------------- local bookkeeping
    def add(self, request: Request) -> None:
        """Take a newly submitted request into this set's negotiation."""
        self.pending[request.name] = request
        if request.kind not in UNCACHED_KINDS:
            bit = self.cache.lookup(request.name)
            if bit is not None:
                cached = self.cache.entry(bit)
                assert cached is not None
                _, cached_meta = cached
                if cached_meta == request.meta():
                    self.hits[bit] = request
                    self.wire.offer(bit, request)
                    return
                # Same name, different shape/dtype/...: everyone must forget this bit.
                self.stale.add(bit)
        self.unannounced.append(request)

    def forget(self, request: Request) -> None:
        self.pending.pop(request.name, None)

    def drop_all(self) -> list[Request]:
        """Remove and return every pending request (shutdown, removal of the set)."""
        dropped = list(self.pending.values())
        self.pending.clear()
        self.unannounced.clear()
        self.hits.clear()
        return dropped

    @property
    def locally_joined(self) -> bool:
        return self.rank in self.joined

    # ------------------------------------------------------------------------ the round
    def round(self, stopping: bool, stuck: bool = False, extra: np.ndarray | None = None,
              leaving: bool = False, busy_elsewhere: bool = False) -> RoundResult:
        """Run one negotiation round; ``stuck``: this process has waited, idle, too long;
        ``leaving``: this rank stops to leave the job (its program ends), not to rebuild it;
        ``busy_elsewhere``: this rank has requests pending in another process set, whose
        cycles need this set's rounds from every member (the others then keep cycling).

        ``extra``: this rank's ``extra_words`` words for the header's tail, AND-reduced like
        the rest and returned in the result (autotune's channel, :mod:`.autotune_sync`);
        all ones when None.
        """
        self.rounds += 1
        nbits = self.cache.num_bits
        flags = 0
        if self.unannounced:
            flags |= F_ANNOUNCE
        if stopping:
            flags |= F_STOP
        if busy_elsewhere:
            flags |= F_ELSEWHERE
        if self.stalls.due(self.pending):
            flags |= F_STALL
        hits = (1 << nbits) - 1 if self.locally_joined else _mask(self.hits)
        mine = Header(hits, _mask(self.stale), flags, stuck and bool(self.pending), extra)
        # Read before the eviction below: ride areas name their inputs by the bits they had.
        theirs, rode = self.wire.exchange(mine, self.hits, lambda req: wait_for(
            req, self.stalls.report_slow_round, self.stalls.slow_round_after))
        ready_everywhere, stale_anywhere, flags_any, everyone_stuck_word = theirs[:4]

        self._evict(stale_anywhere, nbits)
        # Ranks that set every bit in this header: those joined before this round.
        joined_before = frozenset(self.joined)
        responses: list[Response] = []
        if flags_any & F_ANNOUNCE or stale_anywhere:
            self._exchange_announcements()
        responses.extend(self._cached_ready(ready_everywhere & ~stale_anywhere, nbits,
                                            joined_before, rode))
        responses.extend(self._table_ready())
        # Decided on the same facts everywhere (the stall inspector's failures are not).
        everyone_stuck = everyone_stuck_word and not responses
        gave_up = False  # requests failed because some rank never submitted them
        if flags_any & F_STALL:
            stalled, gave_up = self._inspect_stalls()
            responses.extend(stalled)
        if everyone_stuck:
            responses.extend(self._break_deadlock())
            gave_up = True
        stopping_ranks: list[int] = []
        leaving_ranks: list[int] = []
        if flags_any & F_STOP:
            stopping_ranks, leaving_ranks = self._who_stops(2 if leaving and stopping
                                                            else int(stopping))
        return RoundResult(responses, bool(flags_any & F_STOP), bool(flags_any & F_ELSEWHERE),
                           theirs.extra, stopping_ranks, leaving_ranks, gave_up)

    def _who_stops(self, code: int) -> tuple[list[int], list[int]]:
        """The world ranks that asked to stop in this round, and those of them that leave the
        job (code 2; 1 is a stop to rebuild), so that the others' errors can name them and the
        others can rebuild without the leavers.  Every rank saw the same flag in the same
        round, so all take part; it happens once, at the end."""
        everyone = np.zeros(self.size, dtype=np.uint8)
        wait_for(self.comm.Iallgather(np.array([code], dtype=np.uint8), everyone))
        return ([self.world_ranks[r] for r in np.flatnonzero(everyone).tolist()],
                [self.world_ranks[r] for r in np.flatnonzero(everyone == 2).tolist()])

    def _evict(self, stale_anywhere: int, nbits: int) -> None:
        for bit in _set_bits(stale_anywhere, nbits):
            self.cache.evict(bit)
            request = self.hits.pop(bit, None)
            if request is not None:
                self.unannounced.append(request)
        self.stale.clear()

    def _exchange_announcements(self) -> None:
        self.announcement_rounds += 1
        # Metas travel as plain tuples: the pickles stay as small as the fields themselves and
        # name no class of ours; each rank rebuilds the named tuple on arrival.
        mine = [(r.name, tuple(r.meta())) for r in self.unannounced]
        self.unannounced.clear()
        for rank, items in enumerate(self.comm.allgather(mine)):
            for name, fields in items:
                meta = RequestMeta._make(fields)
                self.table.setdefault(name, {})[rank] = meta
                if meta.kind == Kind.JOIN and rank not in self.joined:
                    self.joined.append(rank)

    def _cached_ready(self, ready: int, nbits: int, joined: frozenset[int],
                      rode: dict[int, np.ndarray]) -> list[Response]:
        out = []
        entry, hits, pending, done = self.cache.entry, self.hits, self.pending, self.wire.done
        for bit in _set_bits(ready, nbits):  # (a thousand of them after a backward pass)
            cached = entry(bit)
            if cached is None:
                continue
            name, meta = cached
            request = hits.pop(bit, None)
            if request is not None:
                pending.pop(name, None)
                done(bit)
            if joined or rode:
                error = self._joined_error(name, meta, joined)
                out.append(Response(name, meta, request, error=error,
                                    mismatch=error is not None, joined=joined,
                                    reduced=rode.get(bit)))
            else:
                out.append(Response(name, meta, request))
        return out

    def _table_ready(self) -> list[Response]:
        out = []
        joined = frozenset(self.joined)
        everyone = set(range(self.size))
        for name in list(self.table):
            by_rank = self.table[name]
            first_rank = min(by_rank)  # the lowest rank is the reference in messages
            first_meta = by_rank[first_rank]
            if first_meta.kind == Kind.JOIN:
                if set(by_rank) != everyone:
                    continue
                last = self.joined[-1]
                self.joined.clear()
            elif not set(by_rank) | joined >= everyone:
                continue
            else:
                last = -1
            del self.table[name]
            request = self.pending.pop(name, None)
            error = self._refusals(name, by_rank)
            for rank, meta in sorted(by_rank.items()):
                if error is None and meta != first_meta:
                    error = describe_mismatch(name, first_meta, first_rank, meta, rank)
                    break
            if error is None and first_meta.kind != Kind.JOIN:
                error = self._joined_error(name, first_meta, joined - set(by_rank))
            out.append(Response(name, first_meta, request, error=error,
                                mismatch=error is not None,
                                joined=(joined - set(by_rank) if first_meta.kind != Kind.JOIN
                                        else frozenset()),
                                from_table=True, last_joined=last))
        return out

    def _refusals(self, name: str, by_rank: dict[int, RequestMeta]) -> str | None:
        """The error for ``name`` when some rank refused its call (see ``request.refusal``)."""
        refused = [(self.world_ranks[r], why) for r, meta in sorted(by_rank.items())
                   if (why := refused_because(meta)) is not None]
        if not refused:
            return None
        kind = Kind(by_rank[min(by_rank)].kind).label
        reasons = "; ".join(f"rank {r}: {why}" for r, why in refused)
        return (f"{kind} '{name}' was refused at the call on "
                f"{ranks_text([r for r, _ in refused])} ({reasons}), so it cannot run on any "
                "rank; every rank must pass valid arguments")

    def _joined_error(self, name: str, meta: RequestMeta, joined: frozenset[int]) -> str | None:
        if not joined or meta.kind in (Kind.ALLREDUCE, Kind.BARRIER, Kind.JOIN):
            return None
        ranks = sorted(self.world_ranks[r] for r in joined)
        return (f"{Kind(meta.kind).label} '{name}' cannot run while rank(s) {ranks} have joined; "
                "only allreduce and barrier continue after join()")

    def remember(self, response: Response) -> None:
        """Record that ``response`` ran: cache it if new, refresh it if cached.

        Called for every response in execution order, identical on every rank.
        """
        if response.error is not None or response.kind in UNCACHED_KINDS:
            return
        if not response.from_table:
            bit = self.cache.lookup(response.name)
            if bit is not None:
                self.cache.touch(bit)
            return
        _, evicted = self.cache.insert(response.name, response.meta)
        if evicted is not None:
            # Everyone evicted the same entry; a repeat already pending under it must now be
            # announced instead.
            request = self.hits.pop(evicted, None)
            if request is not None:
                self.unannounced.append(request)

    # ---------------------------------------------------------------------------- stalls
    def _inspect_stalls(self) -> tuple[list[Response], bool]:
        """Tell which ranks are missing which tensors; fail them after the shutdown time.

        Returns:
            The failed responses of this rank, and whether any rank failed any (the same on
            every rank: decided from what all of them sent).
        """
        self.stalls.last_check = time.monotonic()
        waiting = gather_pending(self.comm, self.pending, self.size, self.joined)
        failed = []
        overdue = self.stalls.warn(waiting, self.world_ranks)
        for name, missing_world, age in overdue:
            response = self._fail_stalled(name, missing_world, age)
            if response is not None:
                failed.append(response)
        return failed, bool(overdue)

    def _break_deadlock(self) -> list[Response]:
        """Every rank is stuck (see the module docstring): fail all pending requests here.

        Runs in the same round on every rank of the set, so the table, the joined list and
        the cache hits are cleared identically everywhere.
        """
        waiting = gather_pending(self.comm, self.pending, self.size, self.joined)
        message = self.stalls.deadlock_message(waiting, self.world_ranks)
        failed = [Response(name, request.meta(), request, error=message)
                  for name, request in self.pending.items()]
        self.pending.clear()
        self.unannounced.clear()
        self.hits.clear()
        self.table.clear()
        self.joined.clear()
        return failed

    def _fail_stalled(self, name: str, missing: list[int], waited: float) -> Response | None:
        """Forget ``name`` here; the failed response, or None if this rank never submitted it."""
        request = self.pending.pop(name, None)
        self.table.pop(name, None)
        for bit, r in list(self.hits.items()):
            if r is request:
                del self.hits[bit]
        if request in self.unannounced:
            self.unannounced.remove(request)
        if request is None:
            return None
        return Response(name, request.meta(), request,
                        error=f"'{name}' stalled for {waited:.0f} s waiting for ranks {missing}; "
                              "giving up (MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS)")


def _mask(bits: Any) -> int:
    """Bit numbers as one integer, bit ``b`` set for each ``b``."""
    mask = 0
    for bit in bits:
        mask |= 1 << bit
    return mask


def _set_bits(mask: int, nbits: int) -> list[int]:
    """The numbers of the bits set in ``mask``, below ``nbits``, lowest first."""
    mask &= (1 << nbits) - 1
    bits = []
    while mask:
        low = mask & -mask
        bits.append(low.bit_length() - 1)
        mask ^= low
    return bits
