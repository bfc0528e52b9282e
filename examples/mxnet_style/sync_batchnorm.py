r"""Train a small conv net with SyncBatchNorm (comm_scope local or global) on scikit-learn's digits.

Launch (2 ranks; drop --allow-run-as-root unless you are root, --oversubscribe unless you
have fewer cores than ranks):

    mpirun --allow-run-as-root --oversubscribe -np 2 \
        python examples/mxnet_style/sync_batchnorm.py --comm-scope global
    mpirun --allow-run-as-root --oversubscribe -np 2 -x MPITRAIN_LOCAL_SIZE=1 \
        python examples/mxnet_style/sync_batchnorm.py --comm-scope local
    python examples/mxnet_style/sync_batchnorm.py                  # a world of one

As AIACC-Training (Perseus) users wrote it: batch-norm layers whose statistics span every rank
(``comm_scope="global"``) or only the ranks of one machine (``comm_scope="local"``, cheaper:
no traffic between machines), here ``mpitrain.SyncBatchNorm(channels, comm_scope=...)``, with
a gluon-style ``Trainer`` over a ``dist_sync_mpi`` KVStore doing the data-parallel update.
``MPITRAIN_LOCAL_SIZE=1`` makes one machine pretend to be one node per rank, so ``local``
really differs from ``global`` on a laptop.  Rank 0 writes checkpoints atomically.  Needs
``pip install 'mpitrain[examples]'``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

try:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import mpitrain as hvd
    from mpitrain import kvstore
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch,examples]' "
             "(in a checkout: pip install -e '.[torch,examples]')")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comm-scope", choices=["global", "local"], default="global")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="peak; cosine decay over the epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/sync_batchnorm")
    return p.parse_args()


def convnet(comm_scope: str) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        hvd.SyncBatchNorm(16, comm_scope=comm_scope),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        hvd.SyncBatchNorm(32, comm_scope=comm_scope),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )


def save_atomically(obj: object, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    hvd.init()
    rank, workers = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed + rank)  # different on purpose: the Trainer equalises
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = (torch.from_numpy(a) for a in train_test_split(
        (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8), y.astype(np.int64),
        test_size=0.2, random_state=0))

    model = convnet(args.comm_scope)
    # Running statistics are buffers, not parameters: start them equal too.
    kvstore.broadcast_parameters(model.state_dict(), root_rank=0)
    trainer = kvstore.Trainer(model.parameters(), "sgd",
                              {"learning_rate": args.lr, "momentum": 0.9, "wd": 1e-4},
                              kvstore="dist_sync_mpi")

    steps = len(x_train) // (args.batch_size * workers)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    for epoch in range(args.epochs):
        trainer.set_learning_rate(args.lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs)))
        model.train()
        order = torch.from_numpy(np.random.default_rng(args.seed + epoch).permutation(
            len(x_train)))
        mine = order[rank::workers]
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            model.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx],
                                                     reduction="sum")
            loss.backward()  # SyncBatchNorm's forward and backward talk within the scope
            trainer.step(args.batch_size * workers)  # dist_sync sums: the global batch
        model.eval()  # running statistics, no communication
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        if rank == 0:
            save_atomically({"model": model.state_dict(), "epoch": epoch + 1},
                            os.path.join(args.checkpoint_dir, "model.pt"))
            print(f"epoch {epoch + 1}/{args.epochs} comm_scope={args.comm_scope} last loss "
                  f"{loss.item() / args.batch_size:.4f} test accuracy {accuracy:.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
