r"""Train a torch MLP on scikit-learn's digits with a gluon-style ``Trainer`` over a KVStore.

Launch (2 ranks; drop --allow-run-as-root unless you are root, --oversubscribe unless you
have fewer cores than ranks):

    mpirun --allow-run-as-root --oversubscribe -np 2 python examples/mxnet_style/gluon_trainer.py
    mpirun --allow-run-as-root --oversubscribe -np 2 \
        python examples/mxnet_style/gluon_trainer.py --horovod
    python examples/mxnet_style/gluon_trainer.py                   # a world of one

Gluon's habit: ``trainer = Trainer(params, "sgd", {...}, kvstore="dist_sync")`` and
``trainer.step(batch_size)`` after ``backward``.  The trainer initialises every parameter in
the store from rank 0 at its first step; the store's replicated server applies the update.
As in MXNet, ``dist_sync`` *sums* gradients over workers, so the step is given the global
batch size.  ``--horovod`` uses Horovod's ``DistributedTrainer`` and
``broadcast_parameters`` instead (averaged gradients, the per-rank batch size).  Rank 0
writes checkpoints (model and trainer states) atomically; every run resumes from them.
Needs ``pip install 'mpitrain[examples]'``.
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

    import mpitrain.mxnet as hvd
    from mpitrain import kvstore
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch,examples]' "
             "(in a checkout: pip install -e '.[torch,examples]')")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--horovod", action="store_true", help="DistributedTrainer, no KVStore")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/gluon_trainer")
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
    hvd.init()
    rank, workers = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed + rank)  # different on purpose: the trainers equalise
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = (torch.from_numpy(a) for a in train_test_split(
        (x / 16.0).astype(np.float32), y.astype(np.int64), test_size=0.2, random_state=0))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    os.makedirs(args.checkpoint_dir, exist_ok=True)
    model_path = os.path.join(args.checkpoint_dir, "model.pt")
    states_path = os.path.join(args.checkpoint_dir, "trainer.states")
    start = 0
    if os.path.exists(model_path):  # every rank reads; rank 0 wrote it
        saved = torch.load(model_path)
        model.load_state_dict(saved["model"])
        start = saved["epoch"]
    optimizer_params = {"learning_rate": args.lr, "momentum": 0.9}
    if args.horovod:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        trainer: kvstore.Trainer = hvd.DistributedTrainer(model.parameters(), "sgd",
                                                          optimizer_params)
        step_batch = args.batch_size  # gradients are averaged: the per-rank batch
    else:
        trainer = kvstore.Trainer(model.parameters(), "sgd", optimizer_params,
                                  kvstore="dist_sync")
        step_batch = args.batch_size * workers  # gradients are summed: the global batch
    if start and os.path.exists(states_path):
        trainer.load_states(states_path)
        if rank == 0:
            print(f"resumed after epoch {start}", flush=True)

    steps = len(x_train) // (args.batch_size * workers)
    for epoch in range(start, args.epochs):
        order = torch.from_numpy(np.random.default_rng(args.seed + epoch).permutation(
            len(x_train)))
        mine = order[rank::workers]
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            model.zero_grad()
            # Summed over the batch, as gluon losses are; step() divides by step_batch.
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx],
                                                     reduction="sum")
            loss.backward()
            trainer.step(step_batch)
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
        trainer.save_states(states_path)  # collective: rank 0 writes, all wait for it
        if rank == 0:
            save_atomically({"model": model.state_dict(), "epoch": epoch + 1}, model_path)
            print(f"epoch {epoch + 1}/{args.epochs} last loss "
                  f"{loss.item() / args.batch_size:.4f} test accuracy {accuracy:.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
