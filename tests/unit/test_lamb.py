"""LAMB against steps worked out by hand, its edge cases, and its checkpointed state."""

from __future__ import annotations

import pytest
import torch

from mpitrain.torch.lamb import Lamb


def _step(opt: Lamb, p: torch.nn.Parameter, grad: list[float]) -> None:
    p.grad = torch.tensor(grad, dtype=p.dtype)
    opt.step()


def test_two_steps_match_the_hand_computation():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    # Step 1, g = [0.5, -1]: bias-corrected moments are m^ = g, v^ = g*g, so Adam's direction
    # is g / (|g| + 1e-6) = [0.999998, -0.999999]; plus 0.01 * w = [0.03, 0.04] gives
    # u = [1.029998, -0.959999], ||u|| = 1.4080106, ||w|| = 5, trust ratio 5 / 1.4080106 =
    # 3.5511095, and w - 0.1 * 3.5511095 * u = [2.6342364, 4.3409062].
    _step(opt, p, [0.5, -1.0])
    assert p.detach().tolist() == pytest.approx([2.6342364, 4.3409062], abs=1e-7)
    # Step 2, g = [0.25, 0.5]: m = [0.07, -0.04], v = [3.1225e-4, 1.249e-3]; divided by
    # 1 - 0.9^2 = 0.19 and 1 - 0.999^2 = 0.001999: m^ = [0.3684211, -0.2105263],
    # v^ = [0.1562031, 0.6248124]; u = m^ / (sqrt(v^) + 1e-6) + 0.01 * w
    # = [0.9585196, -0.2229276]; ||w|| = 5.0776636, ||u|| = 0.9841019, ratio 5.1596927.
    _step(opt, p, [0.25, 0.5])
    assert p.detach().tolist() == pytest.approx([2.1396697, 4.4559300], abs=1e-7)
    assert opt.state[p]["step"] == 2


def test_a_zero_tensor_takes_a_plain_adam_step():
    # ||w|| = 0: the trust ratio is 1 (a zero-initialised bias must still move).
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = Lamb([p], lr=0.1, eps=1e-6, weight_decay=0.01)
    _step(opt, p, [0.5, -1.0])
    assert p.detach().tolist() == pytest.approx([-0.0999998, 0.0999999], abs=1e-7)


def test_groups_keep_their_own_weight_decay_and_bias_correction():
    decayed = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    plain = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = Lamb([{"params": [decayed]},
                {"params": [plain], "weight_decay": 0.0, "bias_correction": False}],
               lr=0.1, weight_decay=0.01)
    decayed.grad = torch.tensor([0.5, -1.0], dtype=torch.float64)
    plain.grad = torch.tensor([0.5, -1.0], dtype=torch.float64)
    opt.step()
    assert decayed.detach().tolist() == pytest.approx([2.6342364, 4.3409062], abs=1e-7)
    # No decay, no bias correction: u = [0.05, -0.1] / ([0.0158114, 0.0316228] + 1e-6)
    # = [3.1620, -3.1622], ||u|| = 4.4719; ratio 5 / 4.4719 = 1.1181;
    # w - 0.1 * 1.1181 * u = [2.64645, 4.35356].
    assert plain.detach().tolist() == pytest.approx([2.64645, 4.35356], abs=1e-4)


def test_saved_state_continues_exactly():
    torch.manual_seed(0)
    grads = [torch.randn(3, 4) for _ in range(4)]
    start = torch.randn(3, 4)

    def run(steps: list[torch.Tensor], state: dict | None = None,
            weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        p = torch.nn.Parameter((start if weights is None else weights).clone())
        opt = Lamb([p], lr=0.01)
        if state is not None:
            opt.load_state_dict(state)
        for g in steps:
            p.grad = g.clone()
            opt.step()
        return p.detach(), opt.state_dict()

    straight, _ = run(grads)
    half, state = run(grads[:2])
    resumed, _ = run(grads[2:], state, half)
    assert torch.equal(straight, resumed)


def test_half_precision_parameters_keep_float32_moments():
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.bfloat16))
    opt = Lamb([p], lr=0.1)
    _step(opt, p, [0.5, -1.0])
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16
    assert p.float().tolist() == pytest.approx([2.6342364, 4.3409062], abs=2e-2)


@pytest.mark.parametrize("kwargs, message", [
    ({"lr": -1.0}, "lr must be >= 0"),
    ({"betas": (1.0, 0.999)}, r"betas\[0\] must be in"),
    ({"betas": (0.9,)}, "betas must be a pair"),
    ({"eps": "small"}, "eps must be a number"),
    ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
])
def test_bad_hyper_parameters_are_named(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Lamb([torch.nn.Parameter(torch.zeros(1))], **kwargs)
