"""Shared by the DDP tests: a small model with a buffer and an optional unused branch, per-rank
data, and a lock-step comparison of two data-parallel wrappers trained side by side."""

import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as tdist
from mpi4py import MPI
from torch import nn


class Net(nn.Module):
    """Conv + BatchNorm (buffers for broadcast_buffers) + linear head; ``unused`` is skipped
    on odd steps when ``skip_unused`` is set (find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        out = self.head(h.flatten(1))
        return out if skip else out + self.unused(out)


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(rank: int, step: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 2, 4, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def train_lockstep(a: nn.Module, b: nn.Module, rank: int, steps: int = 4,
                   skip_odd: bool = False, accumulate: int = 1,
                   no_sync: bool = False, rtol: float = 1e-5,
                   atol: float = 1e-6) -> list[float]:
    """Train wrappers ``a`` and ``b`` on identical data; assert parameters agree every step
    (within ``rtol``/``atol``).

    Returns a's losses.  With ``accumulate`` > 1, gradients of that many micro-batches add up
    before each step (inside ``no_sync()`` for all but the last when ``no_sync`` is set).
    """
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(steps):
        skip = skip_odd and step % 2 == 1
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            for micro in range(accumulate):
                x, y = batch(rank, step * accumulate + micro)
                last = micro == accumulate - 1
                ctx = model.no_sync() if no_sync and not last else _null()
                with ctx:
                    loss = nn.functional.cross_entropy(model(x, skip=skip), y)
                    loss.backward()
            opt.step()
            if model is a:
                losses.append(float(loss.detach()))
        for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
            torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
        for (name, ba), bb in zip(a.module.named_buffers(), b.module.buffers()):
            torch.testing.assert_close(ba, bb, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name, s=step: f"{n} step {s}: {m}")
    return losses


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def gloo_world() -> Iterator[object]:
    """torch's default group over Gloo, set up as an mpirun user would (rank and size from
    MPI, a free port on localhost found by rank 0); for a module-scoped fixture."""
    world = MPI.COMM_WORLD
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    # Gloo connects its pairs over the interface the host name resolves to; the ranks of a
    # test job share one host, so loopback always works (on the lent GPU VM this suite failed
    # at 2 ranks and did not finish at 4 while our own backend's tests passed: suspected, not
    # shown, to be that interface).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                             rank=world.Get_rank(), world_size=world.Get_size())
    yield tdist.group.WORLD
    tdist.destroy_process_group()
