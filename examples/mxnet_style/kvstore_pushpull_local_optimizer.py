r"""Train a torch MLP on scikit-learn's digits: KVStore ``pushpull`` of gradients, local optimizer.

Launch (2 ranks; drop --allow-run-as-root unless you are root, --oversubscribe unless you
have fewer cores than ranks):

    mpirun --allow-run-as-root --oversubscribe -np 2 \
        python examples/mxnet_style/kvstore_pushpull_local_optimizer.py
    python examples/mxnet_style/kvstore_pushpull_local_optimizer.py   # a world of one

The MXNet/Horovod-KVStore habit of "update locally": the store only sums.  ``kv.broadcast``
gives every rank rank 0's initial weights; each step ``kv.pushpull(key, grad)`` replaces every
gradient by its sum over ranks, in place, and an ordinary ``torch.optim.SGD`` updates each
rank's copy (the same update everywhere).  Rank 0 writes checkpoints (model and optimizer)
atomically.  Needs ``pip install 'mpitrain[examples]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from mpitrain import kvstore
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch,examples]' "
             "(in a checkout: pip install -e '.[torch,examples]')")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by workers")
    p.add_argument("--gradient-compression", choices=["none", "fp16", "bf16"], default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/kvstore_pushpull_local_optimizer")
    return p.parse_args()


def save_atomically(obj: object, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    kv = kvstore.create("horovod")
    rank, workers = kv.rank, kv.num_workers
    torch.manual_seed(args.seed + rank)  # different on purpose: the broadcast equalises
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = (torch.from_numpy(a) for a in train_test_split(
        (x / 16.0).astype(np.float32), y.astype(np.int64), test_size=0.2, random_state=0))

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    params = list(model.parameters())
    for key, p in enumerate(params):
        kv.broadcast(key, p.detach(), out=p.detach())
    if args.gradient_compression != "none":
        kv.set_gradient_compression({"type": args.gradient_compression})
    opt = torch.optim.SGD(params, lr=args.lr * workers, momentum=0.9)

    steps = len(x_train) // (args.batch_size * workers)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng(args.seed + epoch).permutation(
            len(x_train)))
        mine = order[rank::workers]
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            grads = [p.grad for p in params]
            kv.pushpull(list(range(len(params))), grads)  # sums over ranks, in place
            for g in grads:
                g.div_(workers)  # the sum of per-rank means -> the global mean
            opt.step()
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        if rank == 0:
            save_atomically({"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "epoch": epoch + 1},
                            os.path.join(args.checkpoint_dir, "checkpoint.pt"))
            print(f"epoch {epoch + 1}/{args.epochs} last loss {loss.item():.4f} "
                  f"test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
