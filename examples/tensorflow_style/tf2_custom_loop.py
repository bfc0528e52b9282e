r"""Train a small MLP on scikit-learn's digits with a TF2 custom loop and DistributedGradientTape.

Launch (2 ranks; drop --allow-run-as-root unless you are root, --oversubscribe unless you
have fewer cores than ranks):

    mpirun --allow-run-as-root --oversubscribe -np 2 \
        python examples/tensorflow_style/tf2_custom_loop.py
    python examples/tensorflow_style/tf2_custom_loop.py            # a world of one

Horovod's TF2 habits, unchanged: the learning rate is scaled by the number of ranks (the
global batch grows with it), the tape is wrapped in ``hvd.DistributedGradientTape``, the
model and optimizer state are broadcast from rank 0 after the first step (the optimizer's
slots exist only then), and only rank 0 prints and writes checkpoints.  Needs
``pip install 'mpitrain[tensorflow,examples]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import mpitrain.tensorflow as hvd
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[tensorflow,examples]' "
             "(in a checkout: pip install -e '.[tensorflow,examples]')")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/tf2_custom_loop")
    return p.parse_args()


def digits() -> tuple[np.ndarray, ...]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return tuple(train_test_split(x, y.astype(np.int64), test_size=0.2, random_state=0))


def save_atomically(model: keras.Model, directory: str) -> str:
    """Rank 0's checkpoint: write a temporary file, flush it to disk, then rename it."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, "model.weights.h5")
    tmp = os.path.join(directory, ".tmp-model.weights.h5")
    model.save_weights(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def main() -> None:
    args = parse_args()
    hvd.init()
    # Each rank starts from its own random weights on purpose: the broadcast makes them equal.
    keras.utils.set_random_seed(args.seed + hvd.rank())
    x_train, x_test, y_train, y_test = digits()

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(learning_rate=args.lr * hvd.size(), momentum=0.9)

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor, first_batch: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    global_batch = args.batch_size * hvd.size()
    steps = len(x_train) // global_batch  # the same on every rank
    for epoch in range(args.epochs):
        # One permutation for all ranks (same seed); rank r takes every size-th sample.
        order = np.random.default_rng(args.seed + epoch).permutation(len(x_train))
        mine = order[hvd.rank()::hvd.size()]
        losses = []
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            losses.append(float(train_step(x_train[idx], y_train[idx],
                                           epoch == 0 and step == 0)))
        mean_loss = float(hvd.allreduce(np.mean(losses), op=hvd.Average))
        logits = model(x_test[hvd.rank()::hvd.size()], training=False)
        correct = np.sum(np.argmax(logits, axis=1) == y_test[hvd.rank()::hvd.size()])
        total = hvd.allreduce(np.array([correct, len(logits)], np.int64), op=hvd.Sum).numpy()
        if hvd.rank() == 0:
            path = save_atomically(model, args.checkpoint_dir)
            print(f"epoch {epoch + 1}/{args.epochs} loss {mean_loss:.4f} "
                  f"test accuracy {total[0] / total[1]:.4f} (checkpoint {path})", flush=True)


if __name__ == "__main__":
    main()
