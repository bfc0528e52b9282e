"""torch.distributed's backend "mpitrain" on CUDA tensors (issue 18): every collective a
library such as Hugging Face's Trainer or stock DDP issues, on tensors that live on the GPU,
against values computed on the CPU; point-to-point messages; and stock torch DDP on CUDA over
mpitrain training step for step like stock DDP on the CPU over the same backend.

All ranks of a job share the machine's GPU(s) (NCCL refuses that; mpitrain does not).
"""

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
R = dist.ReduceOp


@pytest.fixture(scope="module")
def pg(hvd):
    import mpitrain.torch  # noqa: F401 - registers the backend

    dist.init_process_group(backend="mpitrain")
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def device(hvd):
    return torch.device("cuda", torch.cuda.current_device())


def per_rank(rank: int, n: int = 1000, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.rand(n, generator=gen) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "PRODUCT"])
def test_all_reduce_on_cuda(pg, device, op, dtype):
    if op == "PRODUCT" and dtype != torch.float32:
        pytest.skip("a product of 16-bit values overflows; float32 covers the fold path")
    rows = torch.stack([per_rank(r).double() for r in range(SIZE)])
    expected = {"SUM": rows.sum(0), "AVG": rows.mean(0), "MAX": rows.max(0).values,
                "PRODUCT": rows.prod(0)}[op]
    t = per_rank(RANK, dtype=dtype).to(device)
    dist.all_reduce(t, op=getattr(R, op))
    assert t.device == device and t.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(t.cpu().double(), expected, rtol=tol, atol=tol)


def test_all_reduce_of_many_tensors_async(pg, device):
    tensors = [per_rank(RANK, n).to(device) for n in (1, 7, 4096, 300_001)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    for n, t in zip((1, 7, 4096, 300_001), tensors):
        expected = sum(per_rank(r, n).double() for r in range(SIZE))
        torch.testing.assert_close(t.cpu().double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("root", sorted({0, SIZE - 1}))
def test_broadcast_on_cuda(pg, device, root):
    t = per_rank(RANK).to(device)
    dist.broadcast(t, src=root)
    torch.testing.assert_close(t.cpu(), per_rank(root))


def test_all_gather_and_reduce_scatter_on_cuda(pg, device):
    mine = per_rank(RANK, 33).to(device)
    out = torch.empty(SIZE * 33, device=device)
    dist.all_gather_into_tensor(out, mine)
    torch.testing.assert_close(out.cpu(), torch.cat([per_rank(r, 33) for r in range(SIZE)]))
    parts = [torch.empty(33, device=device) for _ in range(SIZE)]
    dist.all_gather(parts, mine)
    for r, p in enumerate(parts):
        torch.testing.assert_close(p.cpu(), per_rank(r, 33))

    full = per_rank(RANK, SIZE * 5).to(device)
    block = torch.empty(5, device=device)
    dist.reduce_scatter_tensor(block, full)
    total = sum(per_rank(r, SIZE * 5).double() for r in range(SIZE))
    torch.testing.assert_close(block.cpu().double(), total[RANK * 5:(RANK + 1) * 5],
                               rtol=1e-5, atol=1e-5)


def test_all_to_all_and_scatter_on_cuda(pg, device):
    def value(src, dst):
        return torch.full((2,), float(10 * src + dst))

    inp = torch.cat([value(RANK, d) for d in range(SIZE)]).to(device)
    out = torch.empty(2 * SIZE, device=device)
    dist.all_to_all_single(out, inp)
    torch.testing.assert_close(out.cpu(), torch.cat([value(s, RANK) for s in range(SIZE)]))

    got = torch.empty(2, device=device)
    pieces = [value(0, d).to(device) for d in range(SIZE)] if RANK == 0 else None
    dist.scatter(got, pieces, src=0)
    torch.testing.assert_close(got.cpu(), value(0, RANK))


def test_objects_and_barrier(pg, device):
    gathered = [None] * SIZE
    dist.all_gather_object(gathered, {"rank": RANK})
    assert gathered == [{"rank": r} for r in range(SIZE)]
    dist.barrier()


@pytest.mark.world_sizes(2, 3, 4)
def test_send_recv_ring_on_cuda(pg, device):
    right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    out = per_rank(RANK, 257).to(device)
    got = torch.zeros(257, device=device)
    if RANK % 2 == 0:
        dist.send(out, right)
        dist.recv(got, left)
    else:
        dist.recv(got, left)
        dist.send(out, right)
    torch.testing.assert_close(got.cpu(), per_rank(left, 257))


class Net(nn.Module):
    """Linear + BatchNorm (a buffer DDP broadcasts) + a second linear."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(),
                                  nn.Linear(64, 4))

    def forward(self, x):
        return self.body(x)


def _train_ddp(device: torch.device, steps: int = 4, bucket_cap_mb: float = 0.01):
    torch.manual_seed(0)
    model = Net().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + RANK)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_stock_ddp_on_cuda_over_mpitrain_equals_ddp_on_cpu(pg, device):
    on_gpu, on_cpu = _train_ddp(device), _train_ddp(torch.device("cpu"))
    for k in on_cpu:
        torch.testing.assert_close(on_gpu[k].double(), on_cpu[k].double(), rtol=1e-4,
                                   atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # ... and every rank holds the same parameters (BatchNorm's running statistics differ:
    # DDP broadcasts rank 0's before each forward, which then updates them from local data).
    flat = torch.cat([v.double().reshape(-1) for k, v in on_gpu.items() if "running" not in k
                      and "num_batches" not in k])
    everyone = WORLD.allgather(flat.numpy().tobytes())
    assert all(b == everyone[0] for b in everyone)
