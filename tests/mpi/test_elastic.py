"""hvd.elastic under MPI, every rank alive: sync from rank 0, and the run loop's in-place
recovery (restore the last commit, rebuild the job, sync, reset callbacks, retry) after a
collective fails with HorovodInternalError on every rank.

Ranks actually dying (ULFM) are covered by tests/jobs/test_elastic.py.
"""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

# Four ranks as two emulated nodes: node-local and cross communicators are rebuilt too (two
# ranks would add a job start to CI and cover nothing more).
MPI_CONFIGS = ("2x2",)
SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


def _model() -> torch.nn.Module:
    torch.manual_seed(100 + RANK)  # every rank starts different: sync must make them equal
    return torch.nn.Linear(4, 3)


def test_torch_state_sync_takes_rank_0s_state(hvd):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # momentum buffers, different on every rank
    sampler = hvd.elastic.ElasticSampler(range(40), seed=2)
    sampler.processed_num = 8 * (RANK + 1)  # rank 0's count must win
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=RANK)
    state.sync()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    momentum = torch.cat([opt.state[p]["momentum_buffer"].flatten()
                          for p in model.parameters()])
    gathered = hvd.allgather(torch.cat([flat, momentum]).unsqueeze(0), name="elastic.sync")
    assert all(torch.equal(gathered[0], row) for row in gathered)
    assert state.epoch == 0
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 8}
    assert len(sampler) == -(-32 // SIZE)


def test_rebuild_keeps_a_healthy_world_and_collectives_work(hvd):
    assert hvd.session.rebuild() == []
    assert (hvd.rank(), hvd.size()) == (RANK, SIZE)
    out = hvd.allreduce(torch.tensor([float(RANK)]), op=hvd.Sum, name="elastic.after")
    assert out.item() == SIZE * (SIZE - 1) / 2


def test_run_recovers_in_place_from_an_internal_error(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)
    sizes = []
    state.register_reset_callbacks([lambda: sizes.append(hvd.size())])
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(state.step)
        while state.step < 4:
            x = torch.full((2, 4), float(state.step))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            state.step += 1
            if state.step == 2 and len(calls) == 1:
                # A collective failing on every rank: shapes that disagree.
                hvd.allreduce(torch.zeros(RANK + 1), name="elastic.mismatch")
            state.commit()
        return [p.detach().clone() for p in model.parameters()]

    params = train(state)
    # Round 1 failed in step 2 (after step 1's commit): restored to step 1, synced, retried.
    assert calls == [0, 1]
    assert sizes == [SIZE]
    flat = torch.cat([p.flatten() for p in params]).unsqueeze(0)
    gathered = hvd.allgather(flat, name="elastic.params")
    assert all(torch.equal(gathered[0], row) for row in gathered)
    # The result is that of 4 undisturbed steps from rank 0's initial model.
    torch.manual_seed(100)
    ref = torch.nn.Linear(4, 3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        ref_opt.zero_grad()
        ref(torch.full((2, 4), float(step))).sum().backward()
        ref_opt.step()
    for got, want in zip(params, ref.parameters()):
        torch.testing.assert_close(got, want.detach())


def test_a_mismatch_is_catchable_as_horovod_internal_error(hvd):
    with pytest.raises(hvd.HorovodInternalError):
        hvd.allreduce(torch.zeros(RANK + 1), name="elastic.catch")
    out = hvd.allreduce(torch.ones(2), name="elastic.after_catch")  # the engine goes on
    assert torch.equal(out, torch.ones(2))

