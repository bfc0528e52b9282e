"""Stateful compressors (PowerSGD, top-k, 1-bit) against numpy references, on every rank alike,
through DistributedOptimizer and the DDP drop-in, equal to torch's own powerSGD_hook, and
resumed from a checkpoint bit for bit.

Every rank draws every rank's gradients from fixed seeds, so each can compute the expected
average of the whole world itself.
"""

import contextlib
import math
import os
import tempfile

import numpy as np
import pytest
import torch
from ddp_common import gloo_world, make_model, train_lockstep
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import mpitrain as hvd_module
from mpitrain.compression.stateful import powersgd, sparse
from mpitrain.torch.nn.parallel import DistributedDataParallel as DDP

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MPI_CONFIGS = ("np2", "np4")
SHAPES = [(16, 12), (7,), (5, 3, 2, 2), (3, 3)]  # matrices, a vector, a conv kernel, a small one


def grads_of(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(*shape, generator=gen) for shape in SHAPES]


def same_on_every_rank(tensors):
    mine = [t.numpy().tobytes() for t in tensors]
    assert WORLD.allgather(mine) == [mine] * SIZE


# ------------------------------------------------------------------ numpy references
def gram_schmidt(m):
    m = m.copy()
    for i in range(m.shape[1]):
        m[:, i] /= np.linalg.norm(m[:, i])
        for j in range(i + 1, m.shape[1]):
            m[:, j] -= (m[:, i] @ m[:, j]) * m[:, i]
    return m


def powersgd_reference(ms_per_rank, q0, rank):
    """One compressed step of one matrix: every rank's M (n x m) and the shared first Q."""
    q = gram_schmidt(q0)
    p = sum(m @ q for m in ms_per_rank)
    p = gram_schmidt(p)
    q = sum(m.T @ p for m in ms_per_rank) / len(ms_per_rank)
    return p @ q.T


def test_powersgd_step_matches_the_reference_and_feeds_back_its_error(hvd):
    c = hvd.Compression.powersgd(rank=2, start_iter=2)
    for step in range(4):
        mine = grads_of(RANK, step)
        everyone = [grads_of(r, step) for r in range(SIZE)]
        errors = [e.clone() for e in c.errors.get("grads", [torch.zeros(s) for s in SHAPES])]
        q_before = c.q_memory.get("grads", torch.empty(0)).clone()
        before = [g + e for g, e in zip(mine, errors)]
        c.reduce(mine)
        same_on_every_rank(mine)
        if step < 2:  # warm-up: a plain average
            for i, g in enumerate(mine):
                want = sum(e[i] for e in everyone) / SIZE
                torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
            continue
        # Error feedback: what this rank did not send is kept, exactly.
        for b, after, e in zip(before, mine, c.errors["grads"]):
            assert torch.equal(e, b - after)
        # The vector and the 3x3 matrix are not worth compressing at rank 2: plain average
        # (of gradient + error, the error being each rank's own: compare with the all-rank sum).
        all_before = WORLD.allgather([b.numpy() for b in before])
        for i in (1, 3):
            want = sum(r[i] for r in all_before) / SIZE
            np.testing.assert_allclose(mine[i].numpy(), want, rtol=1e-5, atol=1e-6)
        if step == 2:  # the first compressed step: Q is the seeded random start
            m0 = [r[0].reshape(16, 12).astype(np.float64) for r in all_before]
            q0 = torch.empty(0)
            rng = np.random.RandomState(0)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(rng.randint(1_000_000_000))
                q0 = torch.randn(1, 12, 2)[0].numpy().astype(np.float64)
            want = powersgd_reference(m0, q0, 2)
            np.testing.assert_allclose(mine[0].numpy(), want, rtol=1e-4, atol=1e-5)
        assert q_before.numel() == 0 or step > 2


def test_powersgd_on_a_bucket_views_equals_separate_tensors_and_resumes(hvd):
    """Gradients that are views of one flat bucket (DistributedOptimizer's, the drop-in's) get
    error feedback in one operation per bucket: the same bits as tensor by tensor, the state
    still one error per gradient, and a restored state continues on the flat path alike."""
    def bucket_of(tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    on_views = hvd.Compression.powersgd(rank=2, start_iter=2)
    separate = hvd.Compression.powersgd(rank=2, start_iter=2)
    for step in range(5):
        views, tensors = bucket_of(grads_of(RANK, step)), grads_of(RANK, step)
        assert powersgd.flat_span(views) is not None and powersgd.flat_span(tensors) is None
        on_views.reduce(views)
        separate.reduce(tensors)
        for v, t in zip(views, tensors):
            assert torch.equal(v, t), step
    state = on_views.state_dict()
    assert [e.shape for e in state["errors"]["grads"]] == [torch.Size(s) for s in SHAPES]
    for e, want in zip(state["errors"]["grads"], separate.errors["grads"]):
        assert torch.equal(e, want)
    resumed = hvd.Compression.powersgd(rank=2, start_iter=2)
    resumed.load_state_dict(state)
    for step in range(5, 7):
        views, tensors = bucket_of(grads_of(RANK, step)), grads_of(RANK, step)
        resumed.reduce(views)
        separate.reduce(tensors)
        for v, t in zip(views, tensors):
            assert torch.equal(v, t), step


def test_topk_sends_the_largest_entries_and_keeps_the_rest(hvd):
    c = hvd.Compression.topk(ratio=0.1)
    for step in range(3):
        mine = grads_of(RANK, step)
        errors = c.errors.get("grads")
        before = [g + e for g, e in zip(mine, errors)] if errors else [g.clone() for g in mine]
        c.reduce(mine)
        same_on_every_rank(mine)
        all_before = WORLD.allgather([b.numpy() for b in before])
        for i, shape in enumerate(SHAPES):
            n = math.prod(shape)
            k = max(1, math.ceil(0.1 * n))
            sent = []
            for r in range(SIZE):
                flat = all_before[r][i].reshape(-1)
                keep = np.argsort(-np.abs(flat), kind="stable")[:k]
                s = np.zeros_like(flat)
                s[keep] = flat[keep]
                sent.append(s)
            np.testing.assert_allclose(mine[i].numpy().reshape(-1), sum(sent) / SIZE,
                                       rtol=1e-6, atol=1e-7)
            # error + sent == M, exactly (what was sent is M's own entries)
            e = c.errors["grads"][i].numpy().reshape(-1)
            assert np.array_equal(e + sent[RANK], before[i].numpy().reshape(-1))
            assert np.count_nonzero(sent[RANK]) <= k


def test_onebit_sends_scaled_signs_and_keeps_the_rest(hvd):
    c = hvd.Compression.onebit()
    for step in range(3):
        mine = grads_of(RANK, step)
        errors = c.errors.get("grads")
        before = [g + e for g, e in zip(mine, errors)] if errors else [g.clone() for g in mine]
        c.reduce(mine)
        same_on_every_rank(mine)
        all_before = WORLD.allgather([b.numpy() for b in before])
        for i in range(len(SHAPES)):
            sent = [np.abs(r[i]).mean(dtype=np.float32) * np.where(r[i] >= 0, 1.0, -1.0)
                    .astype(np.float32) for r in all_before]
            np.testing.assert_allclose(mine[i].numpy(), sum(sent) / SIZE, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(c.errors["grads"][i].numpy(),
                                       before[i].numpy() - sent[RANK], rtol=0, atol=1e-6)


def test_sign_packing_round_trips():
    values = torch.tensor([0.5, -1.0, 0.0, -0.0, 3.0, -2.0, 1.0, 1.0, -5.0, 2.0, -1.0])
    packed = sparse.pack_signs(values)
    assert packed.dtype == torch.uint8 and packed.numel() == 2
    want = torch.where(values >= 0, 1.0, -1.0)
    assert torch.equal(sparse.unpack_signs(packed, values.numel(), torch.float32), want)


def test_wire_bytes_shrink(hvd):
    plain = 4 * sum(math.prod(s) for s in SHAPES)
    for c, most in ((hvd.Compression.topk(ratio=0.05), plain / 4),
                    (hvd.Compression.onebit(), plain / 8)):
        c.reduce(grads_of(RANK, 0))
        assert 0 < c.wire_bytes <= most, (c, c.wire_bytes, plain)


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _batch(step):
    gen = torch.Generator().manual_seed(1000 * step + RANK)
    return torch.randn(6, 2, 4, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen)


@pytest.mark.parametrize("make", [lambda h: h.Compression.powersgd(rank=1, start_iter=2),
                                  lambda h: h.Compression.topk(ratio=0.2),
                                  lambda h: h.Compression.onebit()],
                         ids=["powersgd", "topk", "onebit"])
def test_distributed_optimizer_resumes_bit_for_bit(hvd, make):
    def fresh():
        model = make_model(seed=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                       momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression=make(hvd))
        return model, opt

    path = hvd.broadcast_object(tempfile.mkdtemp(prefix="mpitrain-compress-") if RANK == 0
                                else None) + "/ckpt.pt"
    model, opt = fresh()
    _train(model, opt, 4)
    hvd.save_checkpoint(path, model=model, optimizer=opt)
    _train(model, opt, 3, start=4)
    straight = [p.detach().clone() for p in model.parameters()]
    same_on_every_rank(straight)

    model, opt = fresh()
    hvd.load_checkpoint(path, model=model, optimizer=opt)
    _train(model, opt, 3, start=4)
    for a, b in zip(straight, model.parameters()):
        assert torch.equal(a, b.detach())


def test_a_stateful_compressor_needs_average(hvd):
    model = make_model()
    with pytest.raises(ValueError, match="op=Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 compression=hvd.Compression.topk(0.1), op=hvd.Sum)
    with pytest.raises(TypeError, match="powersgd"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 compression="powersgd")


@pytest.fixture(scope="module")
def gloo(hvd):
    yield from gloo_world()


@pytest.mark.parametrize("rank", [1, 2])
def test_ddp_dropin_with_powersgd_equals_torch_ddp_with_its_hook(gloo, rank):
    a = DDP(make_model(seed=RANK))
    a.register_comm_hook(None, hvd_module.Compression.powersgd(rank=rank, start_iter=2))
    b = TorchDDP(make_model(seed=RANK), process_group=gloo)
    b.register_comm_hook(torch_powersgd.PowerSGDState(process_group=gloo,
                                                      matrix_approximation_rank=rank,
                                                      start_powerSGD_iter=2),
                         torch_powersgd.powerSGD_hook)
    train_lockstep(a, b, RANK, steps=5)


class Repeated(torch.nn.Module):
    """Three same-shaped hidden layers between two others: what ``batch_same_shape`` stacks."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = torch.nn.Linear(32, 16)
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, skip=False):
        h = torch.relu(self.inp(x.flatten(1)))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


@pytest.mark.parametrize("rank", [1, 3])  # 3: the batched QR, not Gram-Schmidt
def test_ddp_dropin_with_batched_powersgd_equals_torch_ddp_with_its_batched_hook(gloo, rank):
    compressor = hvd_module.Compression.powersgd(rank=rank, start_iter=2,
                                                 batch_same_shape=True)
    a = DDP(Repeated(seed=RANK))
    a.register_comm_hook(None, compressor)
    b = TorchDDP(Repeated(seed=RANK), process_group=gloo)
    b.register_comm_hook(torch_powersgd.PowerSGDState(process_group=gloo,
                                                      matrix_approximation_rank=rank,
                                                      start_powerSGD_iter=2,
                                                      batch_tensors_with_same_shape=True),
                         torch_powersgd.powerSGD_hook)
    train_lockstep(a, b, RANK, steps=5)
    # The three hidden weights went as one stack (not one matrix at a time).
    assert [tuple(t.shape) for stack in compressor._stacks.values() for t in stack] == \
        [(3, 16, 16)]


def test_ddp_dropin_runs_torch_hooks(gloo):
    """torch's own powerSGD_hook, given the drop-in's buckets, trains as torch's DDP does."""
    a = DDP(make_model(seed=RANK))
    a.register_comm_hook(torch_powersgd.PowerSGDState(process_group=gloo,
                                                      matrix_approximation_rank=1,
                                                      start_powerSGD_iter=2),
                         torch_powersgd.powerSGD_hook)
    b = TorchDDP(make_model(seed=RANK), process_group=gloo)
    b.register_comm_hook(torch_powersgd.PowerSGDState(process_group=gloo,
                                                      matrix_approximation_rank=1,
                                                      start_powerSGD_iter=2),
                         torch_powersgd.powerSGD_hook)
    train_lockstep(a, b, RANK, steps=5)
    with pytest.raises(RuntimeError, match="once"):
        a.register_comm_hook(None, hvd_module.Compression.onebit())


@pytest.mark.parametrize("make", [lambda h: h.Compression.powersgd(rank=2, start_iter=2),
                                  lambda h: h.Compression.topk(ratio=0.3),
                                  lambda h: h.Compression.onebit()],
                         ids=["powersgd", "topk", "onebit"])
def test_sum_mode_is_the_average_times_the_world(hvd, make):
    averaged, summed = make(hvd), make(hvd)
    for step in range(5):  # past PowerSGD's warm-up and one error feedback
        a, s = grads_of(RANK, step), grads_of(RANK, step)
        averaged.reduce(a)
        summed.reduce(s, average=False)
        for x, y in zip(a, s):
            torch.testing.assert_close(y, x * SIZE, rtol=1e-5, atol=1e-5)


def test_gradients_accumulated_over_backward_passes_are_compressed_once_per_step(hvd):
    """backward_passes_per_step=2: two micro-batches add up locally, then one compressed
    exchange per optimizer step; every rank ends with the same model."""
    model = make_model(seed=0)
    c = hvd.Compression.powersgd(rank=1, start_iter=2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=c, backward_passes_per_step=2)
    for step in range(4):
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(2 * step + micro)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert c.iter == 4  # one exchange per step (PowerSGD counts them), not per backward
    assert "optimizer.0" in c.errors  # compressed steps ran (start_iter=2)
    same_on_every_rank([p.detach() for p in model.parameters()])


class _TwoBuckets(torch.nn.Module):
    """A head of exactly 1 MiB of gradients (weight and bias), which fills the first bucket
    (backward makes its gradients first; a bucket holds at most its cap), and a body that
    backward reaches afterwards: two buckets."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 511)
        self.head = torch.nn.Linear(511, 512)  # 511 * 512 + 512 float32 = 1 MiB

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _two_bucket_batch(step):
    gen = torch.Generator().manual_seed(10 * step + RANK)
    return torch.randn(8, 16, generator=gen)


@contextlib.contextmanager
def _fusion_threshold(hvd, nbytes):
    """mpitrain re-initialised with another fusion threshold (read at init()), then restored."""
    hvd.shutdown()
    os.environ["MPITRAIN_FUSION_THRESHOLD"] = str(nbytes)
    hvd.init()
    try:
        yield
    finally:
        hvd.shutdown()
        del os.environ["MPITRAIN_FUSION_THRESHOLD"]
        hvd.init()


def test_distributed_optimizer_compresses_a_small_model_in_one_bucket(hvd):
    """Under the fusion threshold (64 MiB by default) the gradients make one bucket per
    element type: one exchange per step, as many collectives as without buckets."""
    model = _TwoBuckets()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.powersgd(rank=2, start_iter=2))
    assert [len(b) for b in opt._compressed.buckets] == [4]


@pytest.mark.parametrize("kind", ["powersgd", "topk"])
def test_distributed_optimizer_begins_buckets_during_backward_and_equals_bucket_reduces(
        hvd, kind):
    """With a 1 MiB fusion threshold the head's gradients fill the first bucket: PowerSGD's
    goes on the wire while backward is still running (its P factors are submitted from the
    hook: wire bytes grow before step()); whatever the overlap, each step equals reducing the
    same buckets one after another with reduce(), and every rank ends with the same
    parameters.  top-k begins nothing early, and equals it too."""
    with _fusion_threshold(hvd, 1 << 20):
        _check_bucketed_optimizer(hvd, kind)


def _check_bucketed_optimizer(hvd, kind):
    def make():
        if kind == "powersgd":
            return hvd.Compression.powersgd(rank=2, start_iter=2)
        return hvd.Compression.topk(ratio=0.1)

    torch.manual_seed(0)
    model = _TwoBuckets()
    twin = _TwoBuckets()
    twin.load_state_dict(model.state_dict())
    compressor, reference = make(), make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=compressor)
    assert [len(b) for b in opt._compressed.buckets] == [2, 2]
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    buckets = [[twin.head.bias, twin.head.weight], [twin.body.bias, twin.body.weight]]
    began_in_backward = []
    for step in range(5):
        x = _two_bucket_batch(step)
        opt.zero_grad()
        before = compressor.wire_bytes
        model(x).square().mean().backward()
        began_in_backward.append(compressor.wire_bytes > before)
        opt.step()

        twin_opt.zero_grad()
        twin(x).square().mean().backward()
        for i, bucket in enumerate(buckets):
            reference.reduce([p.grad for p in bucket], key=f"optimizer.{i}",
                             last=i == len(buckets) - 1)
        twin_opt.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    same_on_every_rank([p.detach() for p in model.parameters()])
    # The warm-up (start_iter=2) sends plain sums from the hook too; top-k sends at step().
    assert began_in_backward == ([True] * 5 if kind == "powersgd" else [False] * 5)


def test_ddp_dropin_begins_compressed_buckets_during_backward(hvd):
    """The drop-in with PowerSGD: the head's bucket (closed first, at 1 MiB) goes on the wire
    before backward reaches the body; each step equals reducing the buckets one by one with
    reduce() afterwards, and every rank ends with the same parameters."""
    torch.manual_seed(0)
    model, twin = _TwoBuckets(), _TwoBuckets()
    twin.load_state_dict(model.state_dict())
    compressor = hvd.Compression.powersgd(rank=2, start_iter=2)
    reference = hvd.Compression.powersgd(rank=2, start_iter=2)
    ddp = DDP(model)
    ddp.register_comm_hook(None, compressor)
    assert [[id(p) for p in b.params] for b in ddp.reducer.buckets] == [
        [id(model.head.bias), id(model.head.weight)], [id(model.body.bias), id(model.body.weight)]]
    on_wire_at_body = []
    model.body.weight.register_hook(lambda g: on_wire_at_body.append(compressor.wire_bytes))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01)
    buckets = [[twin.head.bias, twin.head.weight], [twin.body.bias, twin.body.weight]]
    for step in range(5):
        x = _two_bucket_batch(step)
        opt.zero_grad()
        before = compressor.wire_bytes
        ddp(x).square().mean().backward()
        assert on_wire_at_body[-1] > before  # the head's bucket began mid-backward
        opt.step()

        twin_opt.zero_grad()
        twin(x).square().mean().backward()
        for i, bucket in enumerate(buckets):
            reference.reduce([p.grad for p in bucket], key=f"bucket{i}", last=i == 1)
        twin_opt.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    same_on_every_rank([p.detach() for p in model.parameters()])
