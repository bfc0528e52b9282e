"""mpitrain.kvstore without MPI: update rules against MXNet's formulas, 2-bit packing, checks."""

import math

import numpy as np
import pytest
import torch

from mpitrain.kvstore import SGD, Adam, Updater, create, optimizer
from mpitrain.kvstore.compression import GradientCompression, _pack, _unpack


def test_sgd_momentum_follows_mxnet_formula():
    w = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    g = torch.tensor([0.5, 0.5, -8.0], dtype=torch.float64)
    opt = SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5, clip_gradient=1.0)
    up = Updater(opt)
    want_w, mom = w.clone().numpy(), np.zeros(3)
    for _ in range(3):
        up(0, g, w)
        step = np.clip(g.numpy() * 0.5, -1, 1) + 0.01 * want_w
        mom = 0.9 * mom - 0.1 * step
        want_w = want_w + mom
    np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-12)
    assert g.tolist() == [0.5, 0.5, -8.0]  # the gradient is not modified
    assert opt.num_update == 3


def test_adam_follows_mxnet_formula():
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    g = torch.tensor([0.3, -0.1], dtype=torch.float64)
    up = Updater(Adam(learning_rate=0.01, wd=0.1))
    want, m, v = w.numpy().copy(), np.zeros(2), np.zeros(2)
    for t in range(1, 4):
        up("k", g, w)
        grad = g.numpy() + 0.1 * want
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad ** 2
        lr = 0.01 * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
        want = want - lr * m / (np.sqrt(v) + 1e-8)
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-12)


def test_updater_states_round_trip_and_lr_mult():
    opt = SGD(learning_rate=0.1, momentum=0.5, param_idx2name={0: "fc.weight"})
    opt.set_lr_mult({"fc.weight": 0.0})
    up = Updater(opt)
    w0, w1 = torch.ones(2), torch.ones(2)
    up(0, torch.ones(2), w0)
    up(1, torch.ones(2), w1)
    assert w0.tolist() == [1.0, 1.0] and w1.tolist() == pytest.approx([0.9, 0.9])
    blob = up.get_states(dump_optimizer=True)
    other = Updater(SGD(learning_rate=5.0))
    other.set_states(blob)
    assert other.optimizer.lr == 0.1 and torch.equal(other.states[1], up.states[1])
    assert other.optimizer._index_update_count == {0: 1, 1: 1}
    with pytest.raises(ValueError, match="optimizer state"):
        other.set_states(b"garbage")


def test_optimizer_registry_and_bad_values():
    assert isinstance(optimizer.create("SGD", learning_rate=0.2), SGD)
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer.create("rmsprop")
    with pytest.raises(ValueError, match="momentum"):
        SGD(momentum=1.5)
    with pytest.raises(ValueError, match="clip_gradient"):
        SGD(clip_gradient=0)
    with pytest.raises(TypeError, match="Updater"):
        Updater("sgd")
    scheduled = SGD(learning_rate=1.0, lr_scheduler=lambda n: 0.5 ** n)
    with pytest.raises(ValueError, match="lr_scheduler"):
        scheduled.set_learning_rate(0.1)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 17])
def test_two_bit_pack_round_trip(n):
    codes = torch.from_numpy(np.random.default_rng(n).choice([0, 2, 3], n).astype(np.uint8))
    packed = _pack(codes)
    assert packed.numel() == (n + 3) // 4
    assert torch.equal(_unpack(packed.view(1, -1), n)[0], codes)


def test_compression_params_are_checked():
    assert GradientCompression({"type": "2bit"}).threshold == 0.5
    with pytest.raises(ValueError, match="unknown gradient compression"):
        GradientCompression({"type": "1bit"})
    with pytest.raises(ValueError, match="threshold"):
        GradientCompression({"type": "2bit", "threshold": 0})
    with pytest.raises(ValueError, match="unexpected"):
        GradientCompression({"type": "fp16", "threshold": 1})
    with pytest.raises(TypeError, match="dict"):
        GradientCompression("2bit")


def test_create_refuses_unknown_and_async_types_before_touching_mpi():
    with pytest.raises(ValueError, match="asynchronous"):
        create("dist_async")
    with pytest.raises(ValueError, match="unknown KVStore type"):
        create("nccl2")
