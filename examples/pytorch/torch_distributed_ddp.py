"""A plain torch.distributed + DDP training script that runs on mpitrain with one extra import.

Nothing here is mpitrain's API except ``import mpitrain.torch``, which registers the
"mpitrain" backend: ``init_process_group(backend="mpitrain")`` under mpirun needs no
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (they come from MPI), and stock
``torch.nn.parallel.DistributedDataParallel``, ``DistributedSampler`` and ``dist.all_reduce``
then run on mpitrain's collectives.  ``--backend gloo`` runs the very same script on Gloo (also
without environment variables under mpirun, thanks to the same import), for comparison.

Launch (from the repository root; as root add --allow-run-as-root, with more ranks than cores
--oversubscribe)::

    mpirun -np 2 python examples/pytorch/torch_distributed_ddp.py --backend mpitrain
    mpirun -np 2 python examples/pytorch/torch_distributed_ddp.py --backend gloo
    torchrun --nproc-per-node 2 examples/pytorch/torch_distributed_ddp.py --backend gloo

Both backends print the same losses (to float rounding) for the same seed and rank count.
"""

from __future__ import annotations

import argparse
import sys
import time

try:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import mpitrain.torch  # noqa: F401  (registers backend="mpitrain")
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch,examples]' "
             "(in a checkout: pip install -e '.[torch,examples]')")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="torch.distributed DDP on digits.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="mpitrain", help="mpitrain, gloo, ...")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    digits = load_digits()
    data = TensorDataset(torch.from_numpy((digits.data / 16.0).astype(np.float32)),
                         torch.from_numpy(digits.target))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(args.seed)
    model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    started = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += torch.tensor([float(loss.detach()), 1.0])
        dist.all_reduce(total)  # sum of losses and of steps over ranks
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  mean loss {total[0] / total[1]:.5f}  "
                  f"({dist.get_backend()}, {world} ranks)", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"trained in {time.perf_counter() - started:.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
