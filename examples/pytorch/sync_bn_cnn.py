"""A small CNN with SyncBatchNorm over all ranks or over each node's ranks, on 8x8 digits.

scikit-learn's bundled digits (1,797 images, no download) are sharded across ranks; the model
is converted with ``SyncBatchNorm.convert_sync_batchnorm(model, comm_scope=...)`` and wrapped in
mpitrain's DistributedDataParallel drop-in.  With small per-rank batches, synchronised batch
statistics are what keeps batch norm well behaved; ``--sync-bn-scope local`` synchronises only
among the ranks of a node (cheaper across slow links), ``global`` among all ranks, ``none``
keeps plain per-rank BatchNorm for comparison.  Rank 0 prints.

Launch (from the repository root; as root add --allow-run-as-root, with more ranks than cores
--oversubscribe)::

    python examples/pytorch/sync_bn_cnn.py                               # one process
    mpirun -np 4 python examples/pytorch/sync_bn_cnn.py --sync-bn-scope global
    MPITRAIN_LOCAL_SIZE=2 mpirun -np 4 -x MPITRAIN_LOCAL_SIZE \\
        python examples/pytorch/sync_bn_cnn.py --sync-bn-scope local      # 2 emulated nodes

It reaches about 98% test accuracy in the default 8 epochs at 1, 2 and 4 ranks.
"""

from __future__ import annotations

import argparse
import sys

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn

    import mpitrain as hvd
    from mpitrain.torch.nn.parallel import DistributedDataParallel
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch,examples]' "
             "(in a checkout: pip install -e '.[torch,examples]')")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="SyncBatchNorm CNN on digits with mpitrain.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sync-bn-scope", choices=("global", "local", "none"),
                        default="global", help="ranks that share batch-norm statistics")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, 10))


def shards(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
    # Each rank trains on every size()-th image; everyone evaluates its share of the test set.
    mine = slice(hvd.rank(), None, hvd.size())
    return (torch.from_numpy(x_train[mine]), torch.from_numpy(y_train[mine]),
            torch.from_numpy(x_test[mine]), torch.from_numpy(y_test[mine]))


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = shards(args.seed)
    model = cnn()
    if args.sync_bn_scope != "none":
        model = hvd.SyncBatchNorm.convert_sync_batchnorm(model, comm_scope=args.sync_bn_scope)
    model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Every rank must run the same number of steps (each one is collective).
    steps = min(hvd.allgather_object(len(x_train))) // args.batch_size
    gen = torch.Generator().manual_seed(args.seed + hvd.rank())
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=gen)
        total = 0.0
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            total += float(loss.detach())
        mean_loss = hvd.allreduce(torch.tensor(total / max(steps, 1))).item()
        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).sum()
        counts = hvd.allreduce(torch.tensor([float(correct), float(len(y_test))]), op=hvd.Sum)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {mean_loss:.4f}  "
                  f"test accuracy {counts[0] / counts[1]:.3f}  "
                  f"(sync-bn scope: {args.sync_bn_scope}, {hvd.size()} ranks)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
