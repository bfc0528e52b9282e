r"""Train a numpy MLP on scikit-learn's digits through an MXNet-style KVStore (push / pull).

Launch (2 ranks; drop --allow-run-as-root unless you are root, --oversubscribe unless you
have fewer cores than ranks):

    mpirun --allow-run-as-root --oversubscribe -np 2 \
        python examples/mxnet_style/kvstore_numpy_mlp.py
    python examples/mxnet_style/kvstore_numpy_mlp.py               # a world of one

The MXNet parameter-server habit, without MXNet: ``kv.init`` every weight (rank 0's values
win), ``kv.set_optimizer`` so the store applies the update, then each step ``kv.push`` the
gradients and ``kv.pull`` the new weights.  The store's "server" is replicated on every rank:
the gradients are summed across ranks and every rank applies the same update.  The model is
plain numpy (forward and backward by hand).  Rank 0 writes checkpoints (weights and the
optimizer's states) atomically.  Add ``--gradient-compression 2bit`` for MXNet's 2-bit
compression with error feedback (or ``powersgd``, ``topk``, ``onebit``: mpitrain's
compressors, also with error feedback).  Needs ``pip install 'mpitrain[examples]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import numpy as np
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
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--momentum", type=float, default=0.0,
                   help="keep 0 with 2bit: momentum on top of its error feedback diverges")
    p.add_argument("--gradient-compression", default="none",
                   choices=["none", "fp16", "2bit", "powersgd", "topk", "onebit"])
    p.add_argument("--threshold", type=float, default=0.5, help="for 2bit")
    p.add_argument("--kvstore", default="dist_sync")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/kvstore_numpy_mlp")
    return p.parse_args()


def init_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def glorot(n_in: int, n_out: int) -> np.ndarray:
        limit = np.sqrt(6.0 / (n_in + n_out))
        return rng.uniform(-limit, limit, (n_in, n_out)).astype(np.float32)

    return {"w1": glorot(64, 64), "b1": np.zeros(64, np.float32),
            "w2": glorot(64, 10), "b2": np.zeros(10, np.float32)}


def forward(p: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hidden = np.maximum(x @ p["w1"] + p["b1"], 0.0)
    return hidden, hidden @ p["w2"] + p["b2"]


def loss_and_grads(p: dict[str, np.ndarray], x: np.ndarray,
                   y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Summed cross-entropy over the batch and its gradients (the store rescales them)."""
    hidden, logits = forward(p, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = -np.log(probs[np.arange(len(y)), y] + 1e-12).sum()
    d_logits = probs
    d_logits[np.arange(len(y)), y] -= 1.0
    d_hidden = (d_logits @ p["w2"].T) * (hidden > 0)
    grads = {"w2": hidden.T @ d_logits, "b2": d_logits.sum(0),
             "w1": x.T @ d_hidden, "b1": d_hidden.sum(0)}
    return float(loss), {k: v.astype(np.float32) for k, v in grads.items()}


def save_atomically(path: str, arrays: dict[str, np.ndarray]) -> None:
    tmp = os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    kv = kvstore.create(args.kvstore)
    rank, workers = kv.rank, kv.num_workers
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y, test_size=0.2, random_state=0)

    params = init_params(np.random.default_rng(args.seed + rank))  # rank 0's win at init
    names = sorted(params)
    kv.init(names, [params[k] for k in names])
    kv.pull(names, out=[params[k] for k in names])
    if args.gradient_compression != "none":
        settings = {"type": args.gradient_compression}
        if args.gradient_compression == "2bit":
            settings["threshold"] = args.threshold
        kv.set_gradient_compression(settings)
    # Gradients are summed over the global batch; rescale_grad turns the sum into a mean.
    kv.set_optimizer(kvstore.SGD(learning_rate=args.lr, momentum=args.momentum,
                                 rescale_grad=1.0 / (args.batch_size * workers)))

    steps = len(x_train) // (args.batch_size * workers)
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    for epoch in range(args.epochs):
        order = np.random.default_rng(args.seed + epoch).permutation(len(x_train))
        mine = order[rank::workers]
        total = 0.0
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            loss, grads = loss_and_grads(params, x_train[idx], y_train[idx])
            kv.push(names, [grads[k] for k in names])
            kv.pull(names, out=[params[k] for k in names])
            total += loss
        _, logits = forward(params, x_test)
        accuracy = float(np.mean(logits.argmax(1) == y_test))  # weights equal on all ranks
        kv.save_optimizer_states(os.path.join(args.checkpoint_dir, "optimizer.states"))
        if rank == 0:
            save_atomically(os.path.join(args.checkpoint_dir, "params.npz"), params)
            print(f"epoch {epoch + 1}/{args.epochs} loss {total / (steps * args.batch_size):.4f}"
                  f" (rank 0's share) test accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
