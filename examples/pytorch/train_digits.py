"""Train an MLP on scikit-learn's handwritten digits with Horovod's recipe on mpitrain.

The recipe, step by step: ``hvd.init()``; shard the data with a ``DistributedSampler``; scale
the learning rate by ``hvd.size()`` (each step averages ``size()`` per-rank batches); wrap the
optimizer in ``hvd.DistributedOptimizer``; start every rank from rank 0's weights; log, show a
progress bar and write checkpoints on rank 0 only (``save_checkpoint``/``load_checkpoint`` are
collective and do the rank-0 part themselves).

The digits (1,797 8x8 images) ship inside scikit-learn: no download.  Launch from the
repository root (as root add --allow-run-as-root, with more ranks than cores --oversubscribe)::

    python examples/pytorch/train_digits.py                      # one process
    mpirun -np 4 python examples/pytorch/train_digits.py
    mpirun -np 4 python examples/pytorch/train_digits.py --stop-after-epoch 5   # interrupted
    mpirun -np 4 python examples/pytorch/train_digits.py --resume               # goes on

It reaches about 97% test accuracy in the default 12 epochs at 1, 2 and 4 ranks.  A run
stopped at any epoch and started again with ``--resume`` ends bit for bit where an
uninterrupted run ends.  Without ``--resume``, checkpoints already in ``--checkpoint-dir`` are
an error rather than silently overwritten.  ``--resume`` after a run that finished trains
nothing: it loads the last checkpoint, says so, and evaluates it; ``--resume --epochs 20``
after a 12-epoch run trains 8 more epochs on the schedule of a 20-epoch run (the learning rate
jumps from near zero back to where that schedule is at epoch 12, about 0.4 x its peak, so the
result is not bit for bit that of an uninterrupted 20-epoch run).
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
    from tqdm import tqdm

    import mpitrain as hvd
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[torch,examples]' "
             "(in a checkout: pip install -e '.[torch,examples]')")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Data-parallel MLP on scikit-learn's digits.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12, help="train until this epoch")
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05, help="per-rank learning rate; "
                        "the optimizer uses lr * size()")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--warmup-epochs", type=float, default=2.0,
                        help="ramp the learning rate up from lr to lr * size() (Goyal et al.)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default="checkpoints/digits",
                        help="rank 0 writes epoch-NNN.pt here (the last two are kept)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --checkpoint-dir, if there is "
                        "one (without it, an existing checkpoint is an error, not overwritten)")
    parser.add_argument("--stop-after-epoch", type=int, default=None,
                        help="stop after this epoch's checkpoint, as an interruption would")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--fp16-allreduce", action="store_true",
                        help="send gradients as float16 (same as --compression fp16)")
    parser.add_argument("--compression", default="none",
                        choices=["none", "fp16", "bf16", "powersgd", "topk", "onebit"],
                        help="gradient compression; powersgd/topk/onebit keep error feedback "
                        "(checkpointed per rank)")
    parser.add_argument("--powersgd-rank", type=int, default=4, help="for --compression powersgd")
    return parser.parse_args()


def datasets(seed: int) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target)
    return (torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def learning_rate(args: argparse.Namespace, step: int, total: int) -> float:
    """Warm up from lr to lr * size(), then decay along a cosine to zero at the last step.

    A function of the step alone, so a resumed run needs no scheduler state.
    """
    peak = args.lr * hvd.size()
    warmup = args.warmup_epochs * total / args.epochs
    if step < warmup:
        return args.lr + (peak - args.lr) * step / warmup
    return 0.5 * peak * (1 + np.cos(np.pi * (step - warmup) / max(total - warmup, 1)))


def evaluate(model: nn.Module, test: torch.utils.data.Dataset) -> tuple[float, float]:
    """Accuracy and mean loss over the whole test set, each rank scoring its shard."""
    sampler = hvd.DistributedSampler(test, shuffle=False)
    loader = torch.utils.data.DataLoader(test, batch_size=256, sampler=sampler)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # correct, loss sum, count
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            sums += torch.tensor([(out.argmax(1) == y).sum().item(),
                                  F.cross_entropy(out, y, reduction="sum").item(), len(y)],
                                 dtype=torch.float64)
    model.train()
    correct, loss, count = hvd.allreduce(sums, op=hvd.Sum, name="evaluate").tolist()
    return correct / count, loss / count


def compression(args: argparse.Namespace) -> object:
    """The compressor the flags ask for (a stateful one is an object of its own)."""
    name = "fp16" if args.fp16_allreduce else args.compression
    if name == "powersgd":  # 100 plain steps first, as torch recommends for PowerSGD
        return hvd.Compression.powersgd(rank=args.powersgd_rank, start_iter=100)
    if name == "topk":
        return hvd.Compression.topk(ratio=0.05)
    if name == "onebit":
        return hvd.Compression.onebit()
    return getattr(hvd.Compression, name)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # tiny layers: threads cost more than they bring
    train, test = datasets(args.seed)

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression(args))
    sampler = hvd.DistributedSampler(train, shuffle=True, seed=args.seed)
    # Its own generator, so that torch's global one (dropout) continues exactly on resume.
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler,
                                         generator=torch.Generator())

    template = os.path.join(args.checkpoint_dir, "epoch-{epoch:03d}.pt")
    start_epoch, step = 0, 0
    torch.manual_seed(args.seed + hvd.rank())  # each rank its own dropout masks
    # Rank 0 looks at the directory; every rank acts on its answer.
    found = hvd.broadcast_object(hvd.latest_checkpoint(template) if hvd.rank() == 0 else None)
    if found is not None and not args.resume:
        # Training from scratch would overwrite an earlier run's checkpoints: never silently.
        raise SystemExit(f"{args.checkpoint_dir} already holds {found} from an earlier run: "
                         "pass --resume to continue it, or another --checkpoint-dir")
    if found is not None:
        extra = hvd.load_checkpoint(template, model=model, optimizer=optimizer,
                                    sampler=sampler)
        start_epoch, step = extra["epoch"], extra["step"]
        if hvd.rank() == 0:
            print(f"resumed from {extra['path']} at epoch {start_epoch}, step {step}")
            if start_epoch >= args.epochs:
                print(f"that run already finished (epoch {start_epoch}, --epochs {args.epochs}): "
                      "nothing left to train, only evaluating it; pass a larger --epochs to "
                      "train on (the learning-rate schedule then stretches to the new end)")
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"{hvd.size()} rank(s), {len(train)} training images, {args.batch_size} per "
              f"rank per step, lr {args.lr * hvd.size():g}")
    total_steps = args.epochs * -(-sampler.num_samples // args.batch_size)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                   disable=hvd.rank() != 0 or args.no_progress)
        for x, y in bar:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step, total_steps)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        accuracy, test_loss = evaluate(model, test)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: test accuracy {accuracy:.4f}, test loss {test_loss:.4f}")
        hvd.save_checkpoint(template, model=model, optimizer=optimizer, sampler=sampler,
                            keep_last=2, epoch=epoch + 1, step=step)
        if epoch + 1 == args.stop_after_epoch:
            if hvd.rank() == 0:
                print(f"stopped after epoch {epoch + 1}; continue with --resume")
            return
    accuracy, test_loss = evaluate(model, test)
    if hvd.rank() == 0:
        # Full precision, so that runs can be compared bit for bit.
        print(f"final: test accuracy {accuracy:.4f}, test loss {test_loss!r}, step {step}")


if __name__ == "__main__":
    main()
