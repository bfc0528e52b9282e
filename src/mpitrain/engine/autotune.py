"""Autotune's search: which setting rank 0 tries next, how it scores one, and the CSV log.

``MPITRAIN_AUTOTUNE=1`` (Horovod's ``HOROVOD_AUTOTUNE``) tunes four engine settings on the
running job, as Horovod's ParameterManager does, then freezes the best:

* the fusion threshold (bytes per fused bucket),
* the cycle time (how long the engine gathers a burst of submissions),
* the allreduce algorithm, among those that apply to the layout (``auto``, ``shm`` or
  ``hierarchical``, ``ring``, ``mpi``; Horovod's categorical hierarchical-allreduce choice),
* the number of parallel channels a large bucket is split across.

A variable the user set (``MPITRAIN_FUSION_THRESHOLD``, ``HOROVOD_CYCLE_TIME``,
``MPITRAIN_ALLREDUCE_ALGORITHM``/``HOROVOD_HIERARCHICAL_ALLREDUCE``,
``MPITRAIN_ALLREDUCE_STREAMS``) is not tuned: it keeps its value, as in Horovod.

**Score**, as Horovod's: bytes allreduced per second of wall time over one sample.  A sample is
``steps_per_sample`` training steps; a step ends where a tensor name comes back (the next
iteration submits the same gradients again).  Names the engine generates for unnamed requests
never come back, so for them every cycle that moves data counts as a step.  The first
``warmup_samples`` samples (compilation, first-touch of buffers, the calibration of ``auto``)
are measured with the starting setting and discarded, and so is the first sample of every
(algorithm, channels) pair not run before, which pays that pair's set-up.

**Search**: coordinate descent over a fixed grid of candidates per parameter.  Starting from
the configured setting, it measures every value of one parameter with the others held at the
best so far, keeps the best, and moves to the next parameter (fusion threshold, cycle time,
algorithm, channels); a pass that found something better is followed by another pass over the
settings not yet measured, until a pass measures nothing new or ``max_samples`` trials are
spent.  Then the best setting is frozen.  Chosen over Horovod's Gaussian-process Bayesian
optimisation because it needs no dependency, every step of it can be checked by hand, the
grid's 16 settings fit Horovod's default budget of 20 samples, and, given the same scores, it
makes the same choices (the unit tests replay it).  Its weakness is the one of any search on
one sample per setting: a noisy machine can crown a lucky sample (see the README).

Only rank 0 runs this; the other ranks apply what it decides (:mod:`.autotune_sync`), so a
rank whose clock would have scored differently cannot disagree.  Rank 0 writes the log.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import IO, Any, NamedTuple

from ..core import private
from ..core.config import Config, MiB

# The clock samples are timed with; tests replace it (per rank) to inject timing noise.
clock: Callable[[], float] = time.monotonic

FUSION_THRESHOLDS = (1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB)
CYCLE_TIMES_MS = (0.5, 1.0, 2.5, 5.0, 10.0, 25.0)
CHANNELS = (1, 2, 4)
# Tried in this order; fusion first because the bucket size decides which algorithm wins.
PARAMETERS = ("fusion_threshold", "cycle_time_ms", "algorithm", "channels")

LOG_COLUMNS = ("sample", "status", "fusion_threshold_bytes", "cycle_time_ms",
               "allreduce_algorithm", "channels", "steps", "bytes", "seconds",
               "score_bytes_per_s")


class Setting(NamedTuple):
    """The values autotune controls; every rank runs with the same one at every cycle."""

    fusion_threshold: int
    cycle_time_ms: float
    algorithm: str
    channels: int


def start_setting(config: Config) -> Setting:
    """The setting a job runs with before (and without) autotune."""
    return Setting(config.fusion_threshold, config.cycle_time_ms, config.allreduce_algorithm,
                   config.allreduce_streams)


def algorithms_for(size: int, num_nodes: int) -> tuple[str, ...]:
    """The allreduce algorithms worth trying on this layout (distinct behaviours only).

    A world of one runs a local ring whatever is asked; on one node ``hierarchical`` is
    ``shm`` with an extra step, across nodes ``shm`` falls back to ``hierarchical``.
    """
    if size == 1:
        return ("auto",)
    if num_nodes == 1:
        return ("auto", "shm", "ring", "mpi")
    return ("auto", "hierarchical", "ring", "mpi")


def grids(config: Config, size: int, num_nodes: int) -> dict[str, tuple[Any, ...]]:
    """Candidate values of each parameter; one value (the configured) where it is not tuned."""
    start = start_setting(config)
    fixed = config.explicit
    out: dict[str, tuple[Any, ...]] = {
        "fusion_threshold": FUSION_THRESHOLDS,
        "cycle_time_ms": CYCLE_TIMES_MS,
        "algorithm": algorithms_for(size, num_nodes),
        "channels": CHANNELS if size > 1 else (1,),
    }
    user_set = {
        "fusion_threshold": "fusion_threshold" in fixed,
        "cycle_time_ms": "cycle_time_ms" in fixed,
        "algorithm": bool({"allreduce_algorithm", "hierarchical_allreduce"} & fixed),
        "channels": "allreduce_streams" in fixed,
    }
    for name in PARAMETERS:
        value = getattr(start, name)
        if user_set[name]:
            out[name] = (value,)
        elif value not in out[name]:
            out[name] = (value, *out[name])
    return out


class CoordinateSearch:
    """Coordinate descent over ``grids`` from ``start``; deterministic given the scores.

    Call :meth:`next` for the setting to measure and :meth:`report` with its score, until
    :attr:`done`; :attr:`best` is then the frozen choice.
    """

    def __init__(self, start: Setting, grid: Mapping[str, Iterable[Any]],
                 max_samples: int) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.grid = {name: tuple(grid[name]) for name in PARAMETERS}
        self.max_samples = max_samples
        self.scores: dict[Setting, float] = {}
        self.best = start
        self.best_score = -math.inf
        self.done = False
        self._queue: list[Setting] = [start]
        self._coordinate = len(PARAMETERS) - 1  # the start is measured as a pass of its own
        self._found_in_pass = True

    @property
    def trials(self) -> int:
        return len(self.scores)

    def next(self) -> Setting | None:
        """The setting to measure now; None once the search is done."""
        return None if self.done else self._queue[0]

    def report(self, score: float) -> None:
        """Record the score of :meth:`next`'s setting and move on."""
        if self.done:
            raise RuntimeError("the search is done; nothing is being measured")
        setting = self._queue.pop(0)
        self.scores[setting] = score
        if score > self.best_score:  # ties keep the earlier: the order is fixed
            self.best, self.best_score = setting, score
            self._found_in_pass = True
        if self.trials >= self.max_samples:
            self.done = True
            return
        self._refill()

    def _refill(self) -> None:
        while not self._queue:
            self._coordinate += 1
            if self._coordinate == len(PARAMETERS):
                if not self._found_in_pass:
                    self.done = True  # a whole pass found nothing better: a local optimum
                    return
                self._coordinate, self._found_in_pass = 0, False
            name = PARAMETERS[self._coordinate]
            candidates = (self.best._replace(**{name: value}) for value in self.grid[name])
            self._queue = [s for s in dict.fromkeys(candidates) if s not in self.scores]


class Sample(NamedTuple):
    setting: Setting
    steps: int
    nbytes: int
    seconds: float

    @property
    def score(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


class Autotuner:
    """Rank 0's autotune: counts steps and bytes, scores samples, asks the search, logs.

    The engine tells it when a setting took effect everywhere (:meth:`applied`) and, before
    each batch of allreduces runs, what it is about to run (:meth:`record`).  A sample runs
    from one occurrence of its *anchor* (the first tensor name it sees) to the occurrence
    ``steps_per_sample`` steps later, excluded, counting whole cycles (bytes and time over
    the same cycles, so the score is a true rate).  A sample's bytes are its steps' bytes
    give or take less than one step (the tensors sharing the anchor's cycle at either end),
    for any cutting of steps into cycles, any order within a step and any delay before a
    setting applies (tests/unit/test_autotune.py replays that); clean CI runs at 4 ranks
    twice logged samples off by more than a step, so something outside that model happened
    there (never reproduced directly; tests/mpi/test_autotune.py prints its rows).
    When a sample is complete the tuner moves to the next setting, whose
    :attr:`generation` the engine publishes.  Not thread-safe: the engine thread alone
    calls it.
    """

    def __init__(self, search: CoordinateSearch, warmup_samples: int, steps_per_sample: int,
                 log_path: str = "", verbose: bool = False,
                 now: Callable[[], float] | None = None) -> None:
        self.search = search
        self.steps_per_sample = steps_per_sample
        self.warmups_left = warmup_samples
        self.setting = search.best  # warm-up runs the starting setting
        self.generation = 1
        self.frozen = False
        self.samples = 0
        self._now = now
        self._verbose = verbose
        self._measuring = False
        self._applied = 0
        self._anchor: Hashable | None = None
        self._once: set[Hashable] = set()  # names seen before the anchor came back
        self._count = 0  # occurrences of the anchor in this sample
        self._started = 0.0
        self._bytes = 0
        self._by_setting: dict[Setting, Sample] = {}
        # (algorithm, channels) pairs that have run a sample: the first sample of a new pair
        # pays its set-up (shared-memory state, communicators, kernel compilation) and is
        # discarded like a warm-up, so that a one-time cost does not rule an algorithm out.
        self._warm = {(self.setting.algorithm, self.setting.channels)}
        self._file: IO[str] | None = None
        self._writer: csv.DictWriter[str] | None = None
        if log_path:
            # The job's settings and speeds: the user's alone (0600).  Closed in close().
            self._file = private.open_file(log_path, "w", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=LOG_COLUMNS)
            self._writer.writeheader()
            self._file.flush()

    def _time(self) -> float:
        return (self._now or clock)()

    @property
    def measuring(self) -> bool:
        return self._measuring

    def applied(self, generation: int) -> None:
        """Every rank runs ``generation``'s setting from this cycle on: start its sample."""
        if generation == self.generation and not self.frozen and generation != self._applied:
            self._applied = generation
            self._measuring = True
            self._anchor = None

    def _anchor_at(self, key: Hashable, now: float) -> None:
        self._anchor, self._started, self._count, self._bytes = key, now, 0, 0
        self._once = set()

    def record(self, batch: list[tuple[Hashable, int]]) -> bool:
        """Allreduces about to run, as (name key, bytes); True when a new generation is to
        be published (this batch then runs before it takes effect and counts nowhere)."""
        if not self._measuring or not batch:
            return False
        now = self._time()
        if self._anchor is None:
            self._anchor_at(batch[0][0], now)
        keys = [key for key, _ in batch]
        if self._anchor in keys:
            self._count += 1
            if self._count > self.steps_per_sample and self._sample_done(now):
                return True
        elif self._count == 1 and not self._once.isdisjoint(keys):
            # Another name came back before the anchor: the anchor was a one-off (a metric
            # reduced once at start); anchor on the name that repeats, and start again.
            self._anchor_at(next(k for k in keys if k in self._once), now)
            self._count = 1
        if self._count == 1:
            self._once.update(keys)
        self._bytes += sum(nbytes for _, nbytes in batch)
        return False

    def _sample_done(self, now: float) -> bool:
        """Score the sample ending now; True when a new generation must be published."""
        sample = Sample(self.setting, self._count - 1, self._bytes, now - self._started)
        self.samples += 1
        pair = (self.setting.algorithm, self.setting.channels)
        if self.warmups_left > 0 or pair not in self._warm:
            self.warmups_left = max(0, self.warmups_left - 1)
            self._warm.add(pair)
            self._log(sample, "warmup")
            nxt: Setting | None = self.setting
        else:
            self._log(sample, "trial")
            self._by_setting[self.setting] = sample
            self.search.report(sample.score)
            nxt = self.search.next()
        if nxt is None:
            self._freeze()
            return True
        if nxt == self.setting:
            # Nothing to publish: this occurrence of the anchor opens the next sample.
            self._anchor_at(self._anchor, now)
            self._count = 1
            return False
        self.setting = nxt
        self.generation += 1
        self._measuring = False
        return True

    def _freeze(self) -> None:
        self.frozen = True
        self._measuring = False
        self.setting = self.search.best
        self.generation += 1
        best = self._by_setting[self.setting]
        self._log(best, "best")
        if self._verbose:
            sys.stderr.write(f"mpitrain: autotune froze {_describe(self.setting)} after "
                             f"{self.search.trials} trials ({best.score / MiB:.1f} MiB/s)\n")
        self.close()

    def close(self) -> None:
        """Stop logging (the engine stops); an unfinished search logs its best so far."""
        if not self.frozen and self._writer is not None and self.search.trials:
            best = self._by_setting[self.search.best]
            self._log(best, "stopped")
        if self._file is not None:
            self._file.close()
            self._file = None
            self._writer = None

    def _log(self, sample: Sample, status: str) -> None:
        if self._writer is None or self._file is None:
            return
        s = sample.setting
        self._writer.writerow({
            "sample": self.samples, "status": status, "fusion_threshold_bytes": s.fusion_threshold,
            "cycle_time_ms": f"{s.cycle_time_ms:g}", "allreduce_algorithm": s.algorithm,
            "channels": s.channels, "steps": sample.steps, "bytes": sample.nbytes,
            "seconds": f"{sample.seconds:.6f}", "score_bytes_per_s": f"{sample.score:.1f}"})
        self._file.flush()


def _describe(s: Setting) -> str:
    return (f"fusion threshold {s.fusion_threshold / MiB:g} MiB, cycle time "
            f"{s.cycle_time_ms:g} ms, allreduce {s.algorithm}, {s.channels} channel(s)")
