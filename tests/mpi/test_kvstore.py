"""mpitrain.kvstore across ranks: MXNet's semantics, a replicated server, Trainers equal to one
process on the global batch, compression (2-bit with error feedback against MXNet's scheme)."""

import os
import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpitrain import kvstore
from mpitrain.kvstore import SGD, DistributedTrainer, Trainer, broadcast_parameters

# No topology- or size-specific code: two ranks exercise every path that four would.
MPI_CONFIGS = ("np1", "np2")
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture
def kv(hvd):
    return kvstore.create("dist_sync")


@pytest.fixture
def shared_dir():
    """A directory every rank sees (rank 0 makes it)."""
    path = WORLD.bcast(tempfile.mkdtemp() if RANK == 0 else None, root=0)
    yield path
    WORLD.Barrier()


def grad_of(rank, step, n=5):
    return np.random.default_rng(100 * rank + step).normal(size=n).astype(np.float32)


# ------------------------------------------------------------------------------- semantics
def test_properties(kv, hvd):
    assert (kv.rank, kv.num_workers, kv.local_rank) == (hvd.rank(), hvd.size(),
                                                        hvd.local_rank())
    assert kv.type == "dist_sync" and kvstore.create("horovod").type == "horovod"
    assert kv.is_capable(kvstore.KVStore.OPTIMIZER)
    with pytest.raises(ValueError, match="capability"):
        kv.is_capable("sparse")


def test_init_takes_rank0_values_and_push_sums_devices_and_ranks(kv):
    kv.init(["a", "b"], [np.full(3, RANK, np.float32), torch.full((2,), float(RANK))])
    out = [np.empty(3, np.float32), np.empty(3, np.float32)]
    kv.pull("a", out=out)
    assert all(np.array_equal(o, np.zeros(3)) for o in out)
    # Two "devices" per rank: the store holds the sum over devices and ranks.
    kv.push("a", [np.ones(3, np.float32), np.full(3, RANK + 1, np.float32)])
    kv.pull("a", out=out[0])
    np.testing.assert_allclose(out[0], SIZE + SIZE * (SIZE + 1) / 2)
    b = torch.full((2,), float(RANK))
    kv.pushpull("b", b)  # out=None: in place
    assert b.tolist() == [SIZE * (SIZE - 1) / 2] * 2
    got = torch.empty(4)
    kv.broadcast("c", torch.full((4,), float(RANK + 7)), out=got)
    assert got.tolist() == [7.0] * 4


def test_bad_use_is_refused(kv):
    kv.init(3, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="already initialised"):
        kv.init(3, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="not been initialised"):
        kv.push(4, np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="one type"):
        kv.init("x", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="shape"):
        kv.push(3, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="dtype"):
        kv.push(3, np.zeros(2, np.float64))
    with pytest.raises(ValueError, match="out="):
        kv.pull(3)
    with pytest.raises(ValueError, match="no optimizer"):
        kv.save_optimizer_states("never-written")


def test_replicated_server_applies_the_optimizer_to_the_summed_gradient(kv):
    w0 = np.linspace(-1, 1, 5).astype(np.float32)
    kv.init(0, w0)
    kv.set_optimizer(SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=1 / SIZE))
    weight = np.empty(5, np.float32)
    want, mom = w0.astype(np.float64), np.zeros(5)
    for step in range(4):
        kv.push(0, grad_of(RANK, step))
        if step != 1:  # two pushes in a row: both updates happen, in order
            kv.pull(0, out=weight)
        total = sum(grad_of(r, step).astype(np.float64) for r in range(SIZE)) / SIZE
        mom = 0.9 * mom - 0.1 * (total + 0.01 * want)
        want = want + mom
    np.testing.assert_allclose(weight, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_cast_compression(kv, kind):
    kv.set_gradient_compression({"type": kind})
    kv.init(0, np.zeros(5, np.float32))
    out = np.empty(5, np.float32)
    kv.pushpull(0, grad_of(RANK, 0), out=out)
    want = sum(grad_of(r, 0) for r in range(SIZE))
    np.testing.assert_allclose(out, want, rtol=2e-2 if kind == "bf16" else 2e-3, atol=2e-2)


def test_two_bit_compression_is_mxnets_scheme_with_error_feedback(kv):
    t = 0.5
    kv.set_gradient_compression({"type": "2bit", "threshold": t})
    kv.init(0, np.zeros(5, np.float32))
    residuals = [np.zeros(5) for _ in range(SIZE)]
    out = np.empty(5, np.float32)
    for step in range(6):
        kv.push(0, grad_of(RANK, step))
        kv.pull(0, out=out)
        want = np.zeros(5)
        for r in range(SIZE):  # every rank's quantiser, replayed here
            residuals[r] += grad_of(r, step)
            sent = np.where(residuals[r] >= t, t, np.where(residuals[r] <= -t, -t, 0.0))
            residuals[r] -= sent
            want += sent
        np.testing.assert_allclose(out, want, atol=1e-6)


def _softmax_regression_on_digits(compression):
    """Test accuracy of softmax regression trained through a KVStore (8 epochs)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y, test_size=0.2, random_state=0)
    kv = kvstore.create("dist_sync")
    if compression:
        kv.set_gradient_compression(compression)
    w = np.zeros((64, 10), np.float32)
    kv.init("w", w)
    batch = 32
    kv.set_optimizer(SGD(learning_rate=0.5, rescale_grad=1.0 / (batch * SIZE)))
    for epoch in range(8):
        order = np.random.default_rng(epoch).permutation(len(x_train))[RANK::SIZE]
        for step in range(len(x_train) // (batch * SIZE)):
            idx = order[step * batch:(step + 1) * batch]
            logits = x_train[idx] @ w
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            p[np.arange(batch), y_train[idx]] -= 1.0
            kv.push("w", (x_train[idx].T @ p).astype(np.float32))
            kv.pull("w", out=w)
    assert np.array_equal(w, WORLD.bcast(w, root=0))
    return float(np.mean((x_test @ w).argmax(1) == y_test))


def test_two_bit_compression_with_error_feedback_converges_on_digits(hvd):
    plain = _softmax_regression_on_digits(None)
    two_bit = _softmax_regression_on_digits({"type": "2bit", "threshold": 0.5})
    if RANK == 0:
        print(f"\nsoftmax regression on digits at {SIZE} ranks: accuracy {plain:.4f} "
              f"uncompressed, {two_bit:.4f} with 2bit")
    assert plain > 0.9
    assert two_bit > 0.9 and two_bit >= plain - 0.02


def test_optimizer_states_saved_by_rank0_resume_exactly(kv, shared_dir):
    path = os.path.join(shared_dir, "states")
    kv.init(0, np.ones(5, np.float32))
    kv.set_optimizer(kvstore.Adam(learning_rate=0.01))
    w = np.empty(5, np.float32)
    for step in range(3):
        kv.pushpull(0, grad_of(RANK, step), out=w)
    kv.save_optimizer_states(path, dump_optimizer=True)
    assert os.path.exists(path)
    assert not [f for f in os.listdir(shared_dir) if f.startswith(".tmp")]
    at_save = w.copy()
    straight = []
    for step in (3, 4):
        kv.pushpull(0, grad_of(RANK, step), out=w)
        straight.append(w.copy())

    fresh = kvstore.create("dist_sync")
    fresh.init(0, at_save)
    fresh.set_optimizer(kvstore.Adam(learning_rate=0.5))
    fresh.load_optimizer_states(path)  # states, update counts and the dumped optimizer
    for step, want in zip((3, 4), straight):
        fresh.pushpull(0, grad_of(RANK, step), out=w)
        np.testing.assert_array_equal(w, want)


# -------------------------------------------------------------------------------- Trainers
def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def _data(steps, batch):
    gen = np.random.default_rng(0)
    x = torch.from_numpy(gen.normal(size=(steps * batch, 8)).astype(np.float32))
    y = torch.from_numpy(gen.integers(0, 3, steps * batch))
    return x, y


def _reference(steps, batch, lr=0.1, momentum=0.9):
    """One process, the global batch, plain torch: what every Trainer must reproduce."""
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    x, y = _data(steps, batch)
    for i in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i * batch:(i + 1) * batch]),
                                          y[i * batch:(i + 1) * batch]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(trainer_factory, steps, batch, step_batch, split=False, model=None):
    model = model or _model(RANK * 17)  # rank 0's seed matches the reference
    trainer = trainer_factory(model)
    x, y = _data(steps, batch)
    mine = batch // SIZE
    for i in range(steps):
        lo = i * batch + RANK * mine
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[lo:lo + mine]), y[lo:lo + mine],
                                          reduction="sum").backward()
        if split:
            trainer.allreduce_grads()
            trainer.update(step_batch)
        else:
            trainer.step(step_batch)
    return model, trainer


PARAMS = {"learning_rate": 0.1, "momentum": 0.9}


@pytest.mark.parametrize(("update_on_kvstore", "split", "compression"),
                         [(True, False, None), (False, False, None), (False, True, None),
                          (True, False, {"type": "fp16"})],
                         ids=["on-kvstore", "local-update", "allreduce_grads+update", "fp16"])
def test_trainer_equals_single_process_large_batch(hvd, update_on_kvstore, split, compression):
    steps, batch = 5, 8 * SIZE
    want = _reference(steps, batch)
    model, _ = _train(lambda m: Trainer(m.parameters(), "sgd", PARAMS, kvstore="dist_sync",
                                        update_on_kvstore=update_on_kvstore,
                                        compression_params=compression),
                      steps, batch, step_batch=batch, split=split)
    tol = 5e-3 if compression else 1e-5
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach(), w, rtol=tol, atol=tol)
    assert all(np.array_equal(p.detach().numpy(), WORLD.bcast(p.detach().numpy(), root=0))
               for p in model.parameters())


def test_distributed_trainer_with_broadcast_parameters(hvd):
    steps, batch = 5, 8 * SIZE
    want = _reference(steps, batch)
    model = _model(RANK * 17)
    broadcast_parameters(model.state_dict(), root_rank=0, prefix="t.")
    model, _ = _train(lambda m: DistributedTrainer(m.parameters(), "sgd", PARAMS,
                                                   gradient_predivide_factor=2.0),
                      steps, batch, step_batch=batch // SIZE, model=model)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("update_on_kvstore", [True, False])
def test_trainer_states_resume_exactly(hvd, shared_dir, update_on_kvstore):
    path = os.path.join(shared_dir, "trainer.states")
    batch = 4 * SIZE

    def factory(m):
        return Trainer(m.parameters(), "adam", {"learning_rate": 0.01},
                       kvstore=kvstore.create("dist_sync"), update_on_kvstore=update_on_kvstore)

    model, trainer = _train(factory, 3, batch, batch)
    trainer.save_states(path)
    saved = [p.detach().clone() for p in model.parameters()]
    _continue(model, trainer, batch)
    straight = [p.detach().clone() for p in model.parameters()]

    resumed_model = _model(RANK * 17)
    with torch.no_grad():
        for p, s in zip(resumed_model.parameters(), saved):
            p.copy_(s)
    resumed = factory(resumed_model)
    resumed.load_states(path)
    _continue(resumed_model, resumed, batch)
    for p, s in zip(resumed_model.parameters(), straight):
        torch.testing.assert_close(p.detach(), s, rtol=0, atol=0)


def _continue(model, trainer, batch):
    x, y = _data(5, batch)
    mine = batch // SIZE
    for i in (3, 4):
        lo = i * batch + RANK * mine
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[lo:lo + mine]), y[lo:lo + mine],
                                          reduction="sum").backward()
        trainer.step(batch)


def test_trainer_refuses_misuse(hvd):
    model = _model(0)
    on_kv = Trainer(model.parameters(), "sgd", PARAMS, kvstore="dist_sync")
    with pytest.raises(ValueError, match="update_on_kvstore=False"):
        on_kv.allreduce_grads()
    with pytest.raises(ValueError, match="no gradient"):
        Trainer(model.parameters(), "sgd", PARAMS, kvstore=None).step(1)
    with pytest.raises(ValueError, match="batch_size"):
        Trainer(model.parameters(), "sgd", PARAMS, kvstore=None).step(0)
    with pytest.raises(TypeError, match="params"):
        Trainer(42, "sgd")


@pytest.mark.parametrize("params", [{"type": "topk", "ratio": 0.4}, {"type": "onebit"},
                                    {"type": "powersgd", "rank": 1, "start_iter": 2}],
                         ids=["topk", "onebit", "powersgd"])
def test_stateful_compressors_push_the_sum_their_reducer_makes(kv, params):
    """A push through set_gradient_compression sums what the compressor itself would (its
    error memory carried across pushes), identically on every rank."""
    from mpitrain.compression.stateful import OneBit, PowerSGD, TopK

    kv.set_gradient_compression(params)
    twin = {"topk": lambda: TopK(0.4), "onebit": OneBit,
            "powersgd": lambda: PowerSGD(rank=1, start_iter=2)}[params["type"]]()
    shape = (6, 5)
    kv.init(3, np.zeros(shape, np.float32))
    out = np.empty(shape, np.float32)
    for step in range(4):
        grad = np.random.default_rng(10 * step + RANK).standard_normal(shape).astype(np.float32)
        kv.push(3, grad)
        kv.pull(3, out=out)
        want = torch.from_numpy(grad.copy())
        twin.reduce([want], key="twin", average=False)
        np.testing.assert_array_equal(out, want.numpy())
        assert np.array_equal(out, WORLD.bcast(out, root=0))
