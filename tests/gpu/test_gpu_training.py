"""Training on CUDA equals training on CPU: the DDP drop-in, SyncBatchNorm and (issue 5's)
DistributedOptimizer, through the GPU data plane."""


import pytest
import torch
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 10))


def _batch(step):
    g = torch.Generator().manual_seed(100 * step + RANK)
    return torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)


def _train(hvd, device, wrap, steps=3):
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(_model()).to(device)
    model, opt = wrap(model)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5, msg=k)


def test_ddp_dropin_with_sync_batchnorm_on_cuda_equals_cpu(hvd):
    from mpitrain.torch.nn.parallel import DistributedDataParallel

    def wrap(model):
        ddp = DistributedDataParallel(model,
                                      device_ids=None if next(model.parameters()).device.type
                                      == "cpu" else [torch.cuda.current_device()])
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    _assert_same(_train(hvd, "cuda", wrap), _train(hvd, "cpu", wrap))


def test_distributed_optimizer_with_sync_batchnorm_on_cuda_equals_cpu(hvd):
    if not hasattr(hvd, "DistributedOptimizer"):
        pytest.skip("needs issue 5's DistributedOptimizer on this branch")

    def wrap(model):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        return model, opt

    _assert_same(_train(hvd, "cuda", wrap), _train(hvd, "cpu", wrap))
