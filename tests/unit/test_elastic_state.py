"""Elastic state and the run loop without MPI: a broadcast that returns its argument (rank 0
of a world of one) and a reset that only counts, so commit/restore/sync and the loop's order
of events are checked on their own."""

from __future__ import annotations

import pytest
import torch

import mpitrain as hvd
from mpitrain.core import runtime
from mpitrain.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    HostUpdateResult,
    ObjectState,
    State,
    run_fn,
)
from mpitrain.torch.elastic import ElasticSampler, TorchState


class Recorded(ObjectState):
    """An ObjectState whose broadcast is logged."""

    def __init__(self, **kwargs):
        self.broadcasts: list = []

        def bcast(obj):
            self.broadcasts.append(obj)
            return obj

        super().__init__(bcast_object=bcast, get_rank=lambda: 0, **kwargs)


def test_faces_expose_the_same_elastic_api():
    import mpitrain.torch as hvd_torch

    assert hvd.elastic.TorchState is hvd_torch.elastic.TorchState
    assert hvd.elastic.ElasticSampler is hvd_torch.elastic.ElasticSampler
    for name in hvd_torch.elastic.__all__:
        assert getattr(hvd.elastic, name) is getattr(hvd_torch.elastic, name), name
    assert hvd.elastic.run is hvd_torch.elastic.run
    assert hvd.elastic.HorovodInternalError is hvd.HorovodInternalError is hvd.MpitrainInternalError
    assert issubclass(HostsUpdatedInterrupt, RuntimeError)


def test_object_state_commit_and_restore():
    state = Recorded(epoch=0, batch=0)
    state.epoch, state.batch = 1, 5
    state.commit()
    state.epoch, state.batch = 2, 9
    state.restore()
    assert (state.epoch, state.batch) == (1, 5)
    assert state.broadcasts == [(0, 0, 0)]  # commit's host-update check, nothing to report


def test_sync_broadcasts_the_saved_values():
    state = Recorded(epoch=3)
    state.epoch = 4  # not committed: sync sends what was saved, as in Horovod
    state.sync()
    assert state.broadcasts == [{"epoch": 3}] and state.epoch == 3


@pytest.mark.parametrize(("update", "skip_sync"), [(HostUpdateResult.removed, True),
                                                   (HostUpdateResult.added, False),
                                                   (HostUpdateResult.mixed, False)])
def test_host_updates_interrupt_the_next_commit_once(update, skip_sync):
    state = Recorded(x=1)
    state.on_hosts_updated(10.0, update)
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        state.commit()
    assert caught.value.skip_sync is skip_sync
    state.commit()  # the news was consumed
    state.on_hosts_updated(5.0, HostUpdateResult.added)  # older than the last: ignored
    state.commit()


def test_reset_callbacks_run_in_order_after_reset():
    calls = []

    class WithReset(Recorded):
        def reset(self):
            calls.append("reset")

    state = WithReset()
    state.register_reset_callbacks([lambda: calls.append("a")])
    state.register_reset_callbacks([lambda: calls.append("b")])
    state.on_reset()
    assert calls == ["reset", "a", "b"]
    with pytest.raises(TypeError, match="3"):
        state.register_reset_callbacks([3])


def test_state_needs_callables():
    with pytest.raises(TypeError, match="bcast_object"):
        State(bcast_object=None, get_rank=lambda: 0)
    with pytest.raises(NotImplementedError, match="save"):
        State(lambda o: o, lambda: 0).save()


def test_run_restores_resets_and_retries_after_an_internal_error():
    events = []
    state = Recorded(step=0)
    state.register_reset_callbacks([lambda: events.append("callback")])

    def train(state):
        events.append(f"train step={state.step}")
        if len(events) == 2:  # first round: progress, no commit, then a collective fails
            state.step = 7
            raise HorovodInternalError("peer died")
        return state.step

    wrapped = run_fn(train, lambda: events.append("reset"))
    state.step = 1
    state.commit()
    events.append("start")
    assert wrapped(state) == 1
    assert events == ["start", "train step=1", "reset", "callback", "train step=1"]
    assert state.broadcasts.count({"step": 1}) == 2  # synced before each round


def test_run_resets_without_restore_or_sync_after_hosts_removed():
    state = Recorded(step=0)
    rounds = []

    def train(state):
        rounds.append(len(state.broadcasts))
        if len(rounds) == 1:
            state.step = 3
            raise HostsUpdatedInterrupt(skip_sync=True)
        return state.step

    assert run_fn(train, lambda: None)(state) == 3  # not restored
    assert rounds == [1, 1]  # the second round skipped the sync


def test_run_treats_torchs_wrapping_of_a_failed_collective_as_one():
    """torch's DDP re-raises a failed collective as a RuntimeError naming ours: the loop
    restores and resets as for HorovodInternalError; any other RuntimeError propagates."""
    state = Recorded(step=0)
    resets = []

    def train(state):
        if not resets:
            state.step = 5
            raise RuntimeError("Got the following error when running the callback: "
                               "MpitrainInternalError: MPI_ERR_PROC_FAILED")
        return state.step

    assert run_fn(train, lambda: resets.append(1))(state) == 0  # restored to the commit
    assert resets == [1]

    def broken(state):
        raise RuntimeError("a bug in the training loop")

    with pytest.raises(RuntimeError, match="a bug in the training loop"):
        run_fn(broken, lambda: None)(Recorded(step=0))


def test_run_wants_a_state():
    with pytest.raises(TypeError, match="State"):
        run_fn(lambda s: s, lambda: None)(object())


def test_torch_state_commit_and_restore(monkeypatch):
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    monkeypatch.setattr(runtime, "size", lambda: 2)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sampler = ElasticSampler(range(10))
    state = TorchState(model, opt, sampler=sampler, epoch=0)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sampler.record_batch(0, 2)
    state.epoch = 1
    state.save()  # commit() without the collective host-update check
    kept = [p.detach().clone() for p in model.parameters()]
    kept_step = opt.state_dict()["state"][0]["step"].item()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sampler.record_batch(1, 2)
    state.epoch = 2
    state.restore()
    assert all(torch.equal(a, b) for a, b in zip(kept, model.parameters()))
    assert opt.state_dict()["state"][0]["step"].item() == kept_step == 1
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 4}
    assert state.epoch == 1 and state.model is model and state.optimizer is opt


def test_torch_state_tracks_a_reassigned_model():
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    state = TorchState(first)
    state.model = second  # tracked and committed at once
    at_assignment = second.weight.detach().clone()
    with torch.no_grad():
        first.weight.add_(1.0)
        second.weight.add_(1.0)
    moved_first = first.weight.detach().clone()
    state.restore()
    assert torch.equal(second.weight, at_assignment)  # the new model's commit came back
    assert torch.equal(first.weight, moved_first)  # the old one is no longer tracked
    assert state.optimizer is None  # no optimizer: a plain value
