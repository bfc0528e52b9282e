"""Issue 17's compressors on CUDA tensors: the same results as on CPU (up to the GPU's
rounding), identical on every rank, state kept on the device, and training through
DistributedOptimizer and the DDP drop-in's comm hook equal to the CPU's."""

import pytest
import torch
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
# Matrices (two of one shape, for batch_same_shape), vectors, a conv kernel.
SHAPES = [(64, 48), (7,), (5, 3, 2, 2), (3, 3), (300,), (64, 48)]

MAKERS = {
    "powersgd": lambda h: h.Compression.powersgd(rank=2, start_iter=2),
    "powersgd-batched": lambda h: h.Compression.powersgd(rank=3, start_iter=2,
                                                         batch_same_shape=True),
    "topk": lambda h: h.Compression.topk(ratio=0.2),
    "onebit": lambda h: h.Compression.onebit(),
}


def _grads(step):
    gen = torch.Generator().manual_seed(100 * step + RANK)
    return [torch.randn(*shape, generator=gen) for shape in SHAPES]


def _same_on_every_rank(tensors):
    mine = [t.detach().cpu().numpy().tobytes() for t in tensors]
    assert WORLD.allgather(mine) == [mine] * SIZE


@pytest.mark.parametrize("name", list(MAKERS))
def test_compressor_on_cuda_equals_cpu_and_keeps_its_state_on_the_device(hvd, name):
    on_gpu, on_cpu = MAKERS[name](hvd), MAKERS[name](hvd)
    for step in range(5):  # past PowerSGD's warm-up, with error feedback twice
        gpu = [g.cuda() for g in _grads(step)]
        cpu = _grads(step)
        on_gpu.reduce(gpu)
        on_cpu.reduce(cpu)
        _same_on_every_rank(gpu)
        for i, (g, c) in enumerate(zip(gpu, cpu)):
            assert g.is_cuda
            torch.testing.assert_close(g.cpu(), c, rtol=1e-4, atol=1e-5,
                                       msg=f"{name}, step {step}, tensor {i}")
    for errors in on_gpu.errors.values():
        assert all(e.is_cuda for e in errors)
    for key, tensor in on_gpu.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert tensor.is_cuda, key


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def _train(model, opt, device, steps=6):
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + RANK)
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("name", [*MAKERS, "fp16"])
def test_distributed_optimizer_with_compression_on_cuda_equals_cpu(hvd, name):
    def run(device):
        model = _model().to(device)
        compression = hvd.Compression.fp16 if name == "fp16" else MAKERS[name](hvd)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05,
                                                       momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       compression=compression)
        return _train(model, opt, device)

    gpu, cpu = run("cuda"), run("cpu")
    _same_on_every_rank(gpu)
    for i, (g, c) in enumerate(zip(gpu, cpu)):
        torch.testing.assert_close(g, c, rtol=1e-3, atol=1e-4, msg=f"{name}, parameter {i}")


def test_ddp_dropin_with_powersgd_hook_on_cuda_equals_cpu(hvd):
    from mpitrain.torch.nn.parallel import DistributedDataParallel

    def run(device):
        model = _model().to(device)
        ddp = DistributedDataParallel(
            model, device_ids=None if device == "cpu" else [torch.cuda.current_device()])
        ddp.register_comm_hook(None, hvd.Compression.powersgd(rank=2, start_iter=2))
        return _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), device)

    gpu, cpu = run("cuda"), run("cpu")
    _same_on_every_rank(gpu)
    for i, (g, c) in enumerate(zip(gpu, cpu)):
        torch.testing.assert_close(g, c, rtol=1e-3, atol=1e-4, msg=f"parameter {i}")
