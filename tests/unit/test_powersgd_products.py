"""PowerSGD's skinny products (P = M Q, Q = Mᵀ P): computed as rows on the CPU, they must
equal torch's bmm within rounding, batched or not, whatever the operands' layout."""

import pytest
import torch

from mpitrain.compression.stateful.powersgd import skinny_product


@pytest.mark.parametrize("shape", [(1, 16, 32), (3, 64, 300), (1, 512, 64), (2, 7, 5)])
@pytest.mark.parametrize("rank", [1, 4])
@pytest.mark.parametrize("transposed", [False, True])
def test_skinny_product_equals_bmm(shape, rank, transposed):
    gen = torch.Generator().manual_seed(sum(shape) + rank)
    m = torch.randn(*shape, generator=gen)
    a = m.transpose(1, 2) if transposed else m
    b = torch.randn(shape[0], a.shape[2], rank, generator=gen)
    out = torch.full((shape[0], a.shape[1], rank), float("nan"))
    skinny_product(a, b, out=out)
    # Sums of a.shape[2] products in another order: rounding grows with their count; a wrong
    # layout or transpose would be off by the values themselves.
    torch.testing.assert_close(out, torch.bmm(a, b), rtol=1e-5, atol=1e-6 * a.shape[2])


def test_skinny_product_writes_into_a_view_of_memory():
    """P and Q are views into one flat memory per bucket: the product lands there."""
    memory = torch.zeros(2 * 10 * 3)
    out = memory[10 * 3:].view(1, 10, 3)
    a, b = torch.randn(1, 10, 6), torch.randn(1, 6, 3)
    skinny_product(a, b, out=out)
    torch.testing.assert_close(out, torch.bmm(a, b))
    assert memory[:10 * 3].eq(0).all()
