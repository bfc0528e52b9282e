"""Train a small MLP on scikit-learn's digits with Keras 3 ``model.fit`` and Horovod's callbacks.

Launch (2 ranks; drop --allow-run-as-root unless you are root, --oversubscribe unless you
have fewer cores than ranks):

    mpirun --allow-run-as-root --oversubscribe -np 2 python examples/tensorflow_style/keras_fit.py
    python examples/tensorflow_style/keras_fit.py                  # a world of one

Horovod's Keras habits: ``hvd.DistributedOptimizer`` around the optimizer, the learning rate
scaled by the number of ranks and warmed up to it (``LearningRateWarmupCallback``), rank 0's
state broadcast at the start (``BroadcastGlobalVariablesCallback(0)``), metrics averaged
over ranks (``MetricAverageCallback``), progress and checkpoints on rank 0 only.  The model is
compiled with ``jit_compile=False``: XLA cannot compile mpitrain's collectives.  Needs
``pip install 'mpitrain[tensorflow,examples]'``.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import keras
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import mpitrain.tensorflow.keras as hvd
except ImportError as _missing:  # name the extra that brings it
    sys.exit(f"{_missing}\nthis example needs: pip install 'mpitrain[tensorflow,examples]' "
             "(in a checkout: pip install -e '.[tensorflow,examples]')")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    p.add_argument("--warmup-epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/keras_fit")
    return p.parse_args()


class AtomicCheckpoint(keras.callbacks.Callback):
    """Rank 0's checkpoint after every epoch: a temporary file, flushed, then renamed."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(self.directory, ".tmp-model.weights.h5")
        self.model.save_weights(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, "model.weights.h5"))


def main() -> None:
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: see callbacks
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y.astype(np.int64), test_size=0.2, random_state=0)
    # Every rank must run the same number of steps per epoch: equal shards.
    n = len(x_train) // hvd.size() * hvd.size()
    x_train, y_train = x_train[hvd.rank():n:hvd.size()], y_train[hvd.rank():n:hvd.size()]
    x_val, y_val = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr, momentum=0.9))
    model.compile(optimizer=opt, jit_compile=False, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    callbacks: list[keras.callbacks.Callback] = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr,
                                                 warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:
        callbacks.append(AtomicCheckpoint(args.checkpoint_dir))
    history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                        validation_data=(x_val, y_val), callbacks=callbacks,
                        verbose=2 if hvd.rank() == 0 else 0)
    if hvd.rank() == 0:
        print(f"final val_accuracy {history.history['val_accuracy'][-1]:.4f} (averaged over "
              f"{hvd.size()} ranks); checkpoint in {args.checkpoint_dir}", flush=True)


if __name__ == "__main__":
    main()
