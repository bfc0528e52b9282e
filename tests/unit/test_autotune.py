"""Autotune without MPI: the search's order and choice, sample accounting, the log, the wire."""

import csv
import math

import numpy as np
import pytest

from mpitrain.core import config
from mpitrain.engine import autotune, autotune_sync
from mpitrain.engine.autotune import (
    PARAMETERS,
    Autotuner,
    CoordinateSearch,
    Setting,
    algorithms_for,
    grids,
)

MiB = 1 << 20
START = Setting(64 * MiB, 1.0, "auto", 1)
SMALL_GRID = {"fusion_threshold": (4 * MiB, 64 * MiB), "cycle_time_ms": (1.0, 5.0),
              "algorithm": ("auto", "ring"), "channels": (1, 2)}


def run_search(search, score_of):
    order = []
    while (setting := search.next()) is not None:
        order.append(setting)
        search.report(score_of(setting))
    return order


def separable(best):
    """A score that peaks at ``best``, one penalty per parameter away from it."""
    def score(s):
        return 100.0 - sum(1.0 + PARAMETERS.index(p) for p in PARAMETERS
                           if getattr(s, p) != getattr(best, p))
    return score


def test_coordinate_descent_visits_a_fixed_sequence():
    target = Setting(4 * MiB, 5.0, "ring", 2)
    order = run_search(CoordinateSearch(START, SMALL_GRID, 20), separable(target))
    assert order == [
        START,
        Setting(4 * MiB, 1.0, "auto", 1),  # fusion threshold: the other value
        Setting(4 * MiB, 5.0, "auto", 1),  # cycle time, from the better threshold
        Setting(4 * MiB, 5.0, "ring", 1),
        Setting(4 * MiB, 5.0, "ring", 2),
        # The pass improved, so another pass over the lines through the new best, measuring
        # only what is new; it finds nothing better, so the search ends.
        Setting(64 * MiB, 5.0, "ring", 2),
        Setting(4 * MiB, 1.0, "ring", 2),
        Setting(4 * MiB, 5.0, "auto", 2),
    ]


def test_the_best_is_found_and_ties_keep_the_earlier():
    search = CoordinateSearch(START, SMALL_GRID, 20)
    run_search(search, lambda s: 1.0)  # every setting scores the same
    assert search.best == START and search.done
    target = Setting(64 * MiB, 5.0, "ring", 1)
    search = CoordinateSearch(START, SMALL_GRID, 20)
    run_search(search, separable(target))
    assert search.best == target


def test_a_second_pass_explores_around_a_moved_best():
    # Not separable: 8 MiB-like threshold only pays with ring; the first pass moves the
    # algorithm, the second revisits the threshold with it.
    def score(s):
        return {("ring", 4 * MiB): 10.0, ("ring", 64 * MiB): 3.0,
                ("auto", 4 * MiB): 1.0}.get((s.algorithm, s.fusion_threshold), 2.0)
    search = CoordinateSearch(START, SMALL_GRID, 20)
    order = run_search(search, score)
    assert search.best.algorithm == "ring" and search.best.fusion_threshold == 4 * MiB
    assert Setting(4 * MiB, 1.0, "ring", 1) in order[5:]  # found in the second pass
    assert len(order) == len(set(order))  # nothing measured twice


def test_max_samples_caps_the_trials_and_freezes_the_best_seen():
    scores = iter([5.0, 7.0, 6.0, 9.0, 8.0, 100.0])
    search = CoordinateSearch(START, grids(config.Config(), 4, 1), 5)
    order = run_search(search, lambda s: next(scores))
    assert len(order) == 5 and search.trials == 5 and search.done
    assert search.best == order[3] and search.best_score == 9.0
    with pytest.raises(RuntimeError):
        search.report(1.0)


def test_grid_holds_the_defaults_and_leaves_user_settings_alone():
    g = grids(config.Config(), 4, 1)
    assert g["algorithm"] == ("auto", "shm", "ring", "mpi")
    assert 64 * MiB in g["fusion_threshold"] and 1.0 in g["cycle_time_ms"]
    assert sum(len(v) - 1 for v in g.values()) + 1 <= 20  # one pass fits Horovod's budget
    cfg = config.load({"HOROVOD_FUSION_THRESHOLD": str(3 * MiB),
                       "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "MPITRAIN_CYCLE_TIME": "7"})
    g = grids(cfg, 4, 2)
    assert g["fusion_threshold"] == (3 * MiB,) and g["algorithm"] == ("hierarchical",)
    assert g["cycle_time_ms"] == (7.0,) and len(g["channels"]) == 3
    assert algorithms_for(4, 2) == ("auto", "hierarchical", "ring", "mpi")
    assert algorithms_for(1, 1) == ("auto",) and grids(config.Config(), 1, 1)["channels"] == (1,)
    odd = grids(config.load({}, allreduce_streams=3), 2, 1)  # an override is explicit too
    assert odd["channels"] == (3,)


class Simulated:
    """A training loop driving an Autotuner the way the engine does, on a fake clock.

    Each batch costs ``cost(setting in effect)`` seconds; a published generation takes
    effect at the next batch (the next cycle's header).
    """

    def __init__(self, tuner, cost, steps, batches_per_step=3):
        self.tuner, self.cost, self.now = tuner, cost, 0.0
        self.effective = tuner.setting
        self.pending = None
        self.log = []
        tuner._now = lambda: self.now
        tuner.applied(tuner.generation)
        names = [f"g{i}" for i in range(6)]
        cut = math.ceil(len(names) / batches_per_step)
        for _ in range(steps):
            for b in range(0, len(names), cut):
                self.batch([(n, 1000) for n in names[b:b + cut]])

    def batch(self, items):
        if self.pending is not None:
            self.effective = self.tuner.setting
            self.tuner.applied(self.pending)
            self.pending = None
        self.now += self.cost(self.effective, self.now)
        if self.tuner.record(items):
            self.pending = self.tuner.generation


def tuner(tmp_path, warmup=2, steps=2, max_samples=20, grid=None):
    search = CoordinateSearch(START, grid or SMALL_GRID, max_samples)
    return Autotuner(search, warmup, steps, str(tmp_path / "tune.csv"))


def rows(tmp_path):
    with open(tmp_path / "tune.csv") as f:
        return list(csv.DictReader(f))


def test_tuner_scores_whole_steps_discards_warmup_and_freezes(tmp_path):
    target = Setting(4 * MiB, 5.0, "ring", 2)
    fast = separable(target)

    t = tuner(tmp_path)

    def cost(s, now):
        return 1e-6 if t.samples < 2 else 1.0 / fast(s)  # the warm-up looks fastest of all
    Simulated(t, cost, steps=200)
    assert t.frozen and t.setting == target
    log = rows(tmp_path)
    assert tuple(log[0]) == autotune.LOG_COLUMNS
    statuses = [r["status"] for r in log]
    # Two warm-ups, then the trials, and the frozen choice last.  The first sample of each
    # new (algorithm, channels) pair (ring/1, ring/2, then auto/2 in the second pass) pays
    # its set-up and is discarded as a warm-up too.
    assert statuses[:2] == ["warmup", "warmup"] and statuses[-1] == "best"
    assert statuses.count("warmup") == 2 + 3
    trials = [r for r in log if r["status"] == "trial"]
    assert len(trials) == t.search.trials == 8
    assert all(r["steps"] == "2" and r["bytes"] == str(2 * 6 * 1000) for r in trials)
    best = log[-1]
    assert (int(best["fusion_threshold_bytes"]), float(best["cycle_time_ms"]),
            best["allreduce_algorithm"], int(best["channels"])) == tuple(target)
    assert float(best["score_bytes_per_s"]) == max(float(r["score_bytes_per_s"]) for r in trials)
    # The warm-up's huge score never wins: the best is a trial's.
    assert float(best["score_bytes_per_s"]) < max(float(r["score_bytes_per_s"]) for r in log[:2])


def test_frozen_after_max_samples_and_nothing_after(tmp_path):
    t = tuner(tmp_path, warmup=0, steps=1, max_samples=3)
    Simulated(t, lambda s, now: 1e-3, steps=100)
    log = rows(tmp_path)
    assert [r["status"] for r in log] == ["trial", "trial", "trial", "best"]
    assert t.frozen and not t.measuring
    generation = t.generation
    assert t.record([("g0", 1)]) is False and t.generation == generation


def test_one_off_name_does_not_stall_the_sample(tmp_path):
    t = tuner(tmp_path, warmup=0, steps=2, max_samples=1)
    t._now = iter(range(1000)).__next__
    t.applied(1)
    t.record([("init_metric", 8)])  # reduced once, at start: not a step marker
    for _ in range(4):
        t.record([("a", 10)])
        t.record([("b", 10)])
    assert t.frozen
    assert rows(tmp_path)[0]["bytes"] == "40"  # a, b, a, b: two whole steps


@pytest.mark.parametrize("seed", range(40))
def test_a_samples_bytes_are_its_steps_give_or_take_less_than_one_step(tmp_path, seed):
    # Whatever cycles a step's tensors fall into, in whatever order within the step, and
    # however many cycles a new setting takes to apply, a sample of two steps holds two
    # steps' bytes give or take less than one step (the tensors sharing the anchor's cycle at
    # either end).  The MPI test's workload (tests/mpi/test_autotune.py), on a fake clock.
    import random
    rng = random.Random(seed)
    sizes = [4 * n for n in (7, 1000, 33, 600_000, 5)]
    step_bytes = sum(sizes)
    t = tuner(tmp_path, warmup=1, steps=2)
    now = [0.0]
    t._now = lambda: now[0]
    t.applied(t.generation)
    pending = None  # [generation, cycles until every rank applies it]
    while not t.frozen:
        order = list(range(len(sizes)))
        rng.shuffle(order)
        cycles: list[list[int]] = [[] for _ in range(rng.randint(1, len(sizes)))]
        for i in order:
            cycles[rng.randrange(len(cycles))].append(i)
        for cycle in filter(None, cycles):
            now[0] += rng.random()
            if pending is not None:
                pending[1] -= 1
                if pending[1] == 0:
                    t.applied(pending[0])
                    pending = None
            if t.measuring and t.record([(f"grad.{i}", sizes[i]) for i in cycle]):
                pending = [t.generation, rng.randint(1, 3)]
    samples = [int(r["bytes"]) for r in rows(tmp_path)[:-1]]
    assert samples and all(abs(b - 2 * step_bytes) < step_bytes for b in samples), samples


def test_unfinished_search_logs_its_best_so_far(tmp_path):
    t = tuner(tmp_path, warmup=0, steps=1)
    Simulated(t, lambda s, now: 1e-3, steps=3)
    t.close()
    log = rows(tmp_path)
    assert log[-1]["status"] == "stopped" and not t.frozen


def test_wire_words_survive_the_and_with_the_other_ranks():
    words = autotune_sync.encode(7, Setting(3 * MiB, 2.5, "hierarchical", 4), True)
    silence = np.full(autotune_sync.WORDS, autotune_sync.NOTHING, dtype=np.uint64)
    assert autotune_sync.decode(words & silence & silence) == (
        7, Setting(3 * MiB, 2.5, "hierarchical", 4), True)
    assert autotune_sync.decode(silence) is None


def test_only_rank_zero_speaks_and_each_generation_applies_once(tmp_path):
    cfg = config.load({"MPITRAIN_AUTOTUNE": "1"})
    root = autotune_sync.AutotuneSync.for_job(cfg, 0, 2, 1)
    other = autotune_sync.AutotuneSync.for_job(cfg, 1, 2, 1)
    assert root.tuner is not None and other.tuner is None
    assert np.all(other.outgoing() == autotune_sync.NOTHING)
    reduced = root.outgoing() & other.outgoing()
    assert (other.incoming(reduced) == root.incoming(reduced)
            == Setting(*autotune.start_setting(cfg)))
    assert other.incoming(reduced) is None and other.changes == 1  # the same generation
    off = autotune_sync.AutotuneSync.for_job(config.Config(), 0, 2, 1)
    assert off.tuner is None and np.all(off.outgoing() == autotune_sync.NOTHING)
