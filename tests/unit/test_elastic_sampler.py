"""ElasticSampler without MPI: ranks simulated by setting what runtime.rank()/size() return.

The property that matters: when the world changes size in the middle of an epoch, the samples
of that epoch are neither skipped nor processed twice (beyond the padding of the last round).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from mpitrain.core import runtime
from mpitrain.torch.elastic import ElasticSampler


@contextlib.contextmanager
def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setattr(runtime, "rank", lambda: rank)
        m.setattr(runtime, "size", lambda: size)
        yield


def samplers(monkeypatch, n: int, dataset, state: dict | None = None, **kw) -> list:
    """n samplers, one per simulated rank, optionally continuing from ``state``."""
    out = []
    for r in range(n):
        with as_rank(monkeypatch, r, n):
            s = ElasticSampler(dataset, **kw)
            if state is not None:
                s.load_state_dict(state)
        out.append(s)
    return out


def run_batches(ranks: list, batch: int, count: int | None) -> list[int]:
    """Every rank processes ``count`` batches (None: to the end); returns the indices seen."""
    seen: list[int] = []
    iters = [iter(list(s)) for s in ranks]
    done = 0
    while count is None or done < count:
        batches = [[i for _, i in zip(range(batch), it)] for it in iters]
        if not any(batches):
            break
        for s, b in zip(ranks, batches):
            seen += b
            s.record_batch(done, batch)
        done += 1
    return seen


@pytest.mark.parametrize("shuffle", [True, False])
def test_four_ranks_to_three_mid_epoch_sees_every_sample_once(monkeypatch, shuffle):
    dataset = range(96)
    four = samplers(monkeypatch, 4, dataset, shuffle=shuffle, seed=3)
    seen = run_batches(four, batch=3, count=2)  # 24 samples, then a rank is lost
    state = four[0].state_dict()
    assert state == {"epoch": 0, "processed_num": 24}
    assert all(s.state_dict() == state for s in four)
    three = samplers(monkeypatch, 3, dataset, state, shuffle=shuffle, seed=3)
    assert [len(s) for s in three] == [24, 24, 24]
    seen += run_batches(three, batch=3, count=None)
    assert sorted(seen) == list(range(96))


def test_a_resize_that_leaves_a_remainder_only_pads_the_last_round(monkeypatch):
    dataset = range(100)
    four = samplers(monkeypatch, 4, dataset, seed=1)
    seen = run_batches(four, batch=5, count=1)  # 20 processed, 80 left for 3 ranks
    three = samplers(monkeypatch, 3, dataset, four[0].state_dict(), seed=1)
    seen += run_batches(three, batch=5, count=None)
    assert set(seen) == set(range(100))
    assert len(seen) - 100 == 1  # 80 = 3 * 27 - 1: one sample repeated, as padding


def test_two_resizes_in_one_epoch(monkeypatch):
    dataset = range(120)
    four = samplers(monkeypatch, 4, dataset, seed=5)
    seen = run_batches(four, batch=2, count=3)  # 24
    three = samplers(monkeypatch, 3, dataset, four[0].state_dict(), seed=5)
    seen += run_batches(three, batch=2, count=4)  # 24 more
    two = samplers(monkeypatch, 2, dataset, three[1].state_dict(), seed=5)
    seen += run_batches(two, batch=2, count=None)
    assert sorted(seen) == list(range(120))


def test_every_rank_shares_one_order_per_epoch_and_epochs_differ(monkeypatch):
    dataset = range(40)
    a = samplers(monkeypatch, 2, dataset, seed=9)
    first = [list(s) for s in a]
    assert sorted(first[0] + first[1]) == list(range(40))
    assert first[0] != list(range(0, 40, 2))  # shuffled
    for r, s in enumerate(a):
        with as_rank(monkeypatch, r, 2):
            s.set_epoch(1)
    second = [list(s) for s in a]
    assert second != first
    assert sorted(second[0] + second[1]) == list(range(40))
    b = samplers(monkeypatch, 2, dataset, seed=9)
    assert [list(s) for s in b] == first  # same seed and epoch: same order anywhere


def test_set_epoch_clears_the_processed_count(monkeypatch):
    with as_rank(monkeypatch, 0, 2):
        s = ElasticSampler(range(10), shuffle=False)
        s.record_batch(0, 2)
        assert s.state_dict() == {"epoch": 0, "processed_num": 4}
        assert list(s) == [0, 2, 4, 6, 8]  # iteration follows a reset, not record_batch
        s.reset()
        assert list(s) == [4, 6, 8]
        s.set_epoch(1)
        assert s.state_dict() == {"epoch": 1, "processed_num": 0}
        assert len(s) == 5


def test_fewer_samples_left_than_ranks(monkeypatch):
    with as_rank(monkeypatch, 2, 3):
        s = ElasticSampler(range(10), shuffle=False)
        s.load_state_dict({"epoch": 0, "processed_num": 9})
        assert list(s) == [9] and len(s) == 1  # padded by repeating the one left
        s.load_state_dict({"epoch": 0, "processed_num": 12})
        assert list(s) == [] and len(s) == 0


def test_bad_input_names_the_value(monkeypatch):
    with as_rank(monkeypatch, 0, 1):
        with pytest.raises(TypeError, match="len"):
            ElasticSampler(iter(range(3)))
        with pytest.raises(TypeError, match="'7'"):
            ElasticSampler(range(3), seed="7")
        s = ElasticSampler(range(3))
        with pytest.raises(ValueError, match="-1"):
            s.set_epoch(-1)
        with pytest.raises(ValueError, match="-2"):
            s.record_batch(0, -2)
        with pytest.raises(ValueError, match="processed_num"):
            s.load_state_dict({"epoch": 1})


def test_needs_init_without_a_simulated_rank():
    with pytest.raises(ValueError, match="init"):
        ElasticSampler(range(3))
