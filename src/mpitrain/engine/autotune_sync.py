"""How rank 0's autotune choice reaches every rank: a few words of the negotiation header.

A disagreement on the fusion threshold, the algorithm or the channels is a hang (ranks would
cut buckets differently, or run different collectives), so only rank 0 decides
(:mod:`.autotune`) and every rank applies the decision at the same cycle.  The global set's
negotiation header (one AND-allreduce per cycle, :mod:`.negotiation`) carries
:data:`WORDS` extra words: rank 0 puts its published setting there, every other rank puts all
ones, so the AND leaves rank 0's words on every rank, at no extra message.  Each rank
applies a setting whose generation it has not applied yet right after that round, before
anything of the cycle executes; every rank runs the same rounds, so all switch together.

The words are always present and always decoded, whatever this rank's configuration says:
a rank started without ``MPITRAIN_AUTOTUNE`` (or with other autotune variables) still
follows rank 0, and rank 0 without it publishes nothing (all ones), so the job runs its
configured setting.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from ..core.config import ALLREDUCE_ALGORITHMS, Config
from ..core.dtypes import STORAGE
from .autotune import Autotuner, CoordinateSearch, Setting, grids, start_setting
from .negotiation import Response
from .request import Kind, is_generated

WORDS = 6  # generation, fusion threshold, cycle time (float64 bits), algorithm, channels, frozen
NOTHING = np.uint64(0xFFFFFFFFFFFFFFFF)


def encode(generation: int, setting: Setting, frozen: bool) -> np.ndarray:
    """Rank 0's header words for ``setting``."""
    words = np.empty(WORDS, dtype=np.uint64)
    words[0] = generation
    words[1] = setting.fusion_threshold
    words[2] = np.array([setting.cycle_time_ms], dtype=np.float64).view(np.uint64)[0]
    words[3] = ALLREDUCE_ALGORITHMS.index(setting.algorithm)
    words[4] = setting.channels
    words[5] = int(frozen)
    return words


def decode(words: np.ndarray) -> tuple[int, Setting, bool] | None:
    """(generation, setting, frozen) from the reduced words; None when rank 0 sent nothing."""
    if words[0] == NOTHING:
        return None
    cycle_ms = float(np.array([words[2]], dtype=np.uint64).view(np.float64)[0])
    setting = Setting(int(words[1]), cycle_ms, ALLREDUCE_ALGORITHMS[int(words[3])],
                      int(words[4]))
    return int(words[0]), setting, bool(words[5])


class AutotuneSync:
    """This rank's side of the agreement; rank 0 with autotune on also holds the tuner."""

    def __init__(self, rank: int, tuner: Autotuner | None) -> None:
        self.rank = rank
        self.tuner = tuner if rank == 0 else None
        self.applied_generation = 0
        self.setting: Setting | None = None  # what this rank runs now, once rank 0 sent one
        self.frozen = False
        self.changes = 0  # settings applied, for tests
        self._silence = np.full(WORDS, NOTHING, dtype=np.uint64)

    @classmethod
    def for_job(cls, config: Config, rank: int, size: int, num_nodes: int) -> AutotuneSync:
        """The sync of a new engine; rank 0 starts a tuner when its configuration asks."""
        tuner = None
        if rank == 0 and config.autotune:
            search = CoordinateSearch(start_setting(config), grids(config, size, num_nodes),
                                      config.autotune_max_samples)
            tuner = Autotuner(search, config.autotune_warmup_samples,
                              config.autotune_steps_per_sample, config.autotune_log,
                              verbose=config.logs_info)
        return cls(rank, tuner)

    @property
    def measuring(self) -> bool:
        """Whether rank 0's tuner wants to hear what ran (False everywhere else)."""
        return self.tuner is not None and self.tuner.measuring

    def record(self, set_id: int, data: list[Response]) -> None:
        """Tell rank 0's tuner what a cycle is about to allreduce: a key per name, and bytes."""
        tuner = self.tuner
        assert tuner is not None
        batch: list[tuple[Hashable, int]] = []
        for resp in data:
            if resp.kind != Kind.ALLREDUCE:
                continue
            nbytes = sum(STORAGE[dtype].itemsize * int(np.prod(shape, dtype=np.int64))
                         for dtype, _ndim, shape in resp.meta.tensors)
            # Generated names never repeat: one key for all of them makes each cycle a step.
            batch.append(((set_id, "<unnamed>" if is_generated(resp.name) else resp.name),
                          nbytes))
        tuner.record(batch)

    def outgoing(self) -> np.ndarray:
        """This rank's words for the next global header."""
        tuner = self.tuner
        if tuner is None:
            return self._silence
        return encode(tuner.generation, tuner.setting, tuner.frozen)

    def incoming(self, words: np.ndarray) -> Setting | None:
        """The setting to apply from this cycle on, or None when nothing changed."""
        decoded = decode(words)
        if decoded is None:
            return None
        generation, setting, frozen = decoded
        if generation == self.applied_generation:
            return None
        self.applied_generation = generation
        self.frozen = frozen
        self.changes += 1
        changed = setting != self.setting
        self.setting = setting
        if self.tuner is not None:
            self.tuner.applied(generation)
        return setting if changed else None

    def close(self) -> None:
        if self.tuner is not None:
            self.tuner.close()
