"""A Horovod PyTorch training script as Horovod users write them: nothing in it knows mpitrain.

It runs unchanged on mpitrain through the compatibility route
(``mpitrainrun --horovod-compat -np 2 python pytorch_digits.py``), which is what
tests/jobs/test_horovod_compat_scripts.py checks.  The pattern is Horovod's documented one:
init, pin threads, shard with DistributedSampler, scale the learning rate, wrap the optimizer
(fp16 compression, named parameters), broadcast parameters and optimizer state from rank 0,
average metrics with allreduce, print on rank 0 only.
"""

import argparse

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description="Horovod digits example")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--fp16-allreduce", action="store_true")
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234)
torch.set_num_threads(1)

digits = load_digits()
x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target, dtype=torch.int64)
dataset = torch.utils.data.TensorDataset(x, y)
sampler = torch.utils.data.distributed.DistributedSampler(
    dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=1234)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, op=hvd.Average)


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


for epoch in range(1, args.epochs + 1):
    sampler.set_epoch(epoch)
    model.train()
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    accuracy = metric_average(accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"epoch {epoch} accuracy {accuracy:.3f}")

# Every rank holds the same parameters: the allgathered digests agree.
digest = np.float64(sum(p.double().sum().item() for p in model.parameters()))
digests = hvd.allgather(torch.tensor([digest]))
if hvd.rank() == 0:
    same = bool(torch.all(digests == digests[0]))
    print(f"ranks {hvd.size()} parameters identical {same} final accuracy {accuracy:.3f}")
