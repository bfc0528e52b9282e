"""A Keras ``model.fit`` job under ``hvd.elastic.run`` (mpitrain.tensorflow.keras), for
tests/jobs/test_elastic.py: one rank SIGKILLs itself at a given (epoch, batch) inside ``fit``;
the survivors recover and finish the epochs.  Each rank writes a JSON log: the world sizes it
saw, the epochs the state reached, and a digest of the final weights.

    mpirun --with-ft ulfm -np 3 python keras_elastic_train.py LOGDIR '{"1": [1, 2]}'
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpitrain.tensorflow.keras as hvd  # noqa: E402

EPOCHS, STEPS, BATCH = 3, 6, 8


def main() -> None:
    faulthandler.dump_traceback_later(120, exit=True)
    logdir, schedule = sys.argv[1], json.loads(sys.argv[2])
    original = MPI.COMM_WORLD.Get_rank()
    die_at = schedule.get(str(original))
    log: dict = {"rank": original, "sizes": [], "epochs": []}
    path = os.path.join(logdir, f"rank{original}.json")

    def write_log() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(log, f)
        os.replace(path + ".tmp", path)

    hvd.init()
    tf.random.set_seed(0)
    log["sizes"].append(hvd.size())
    rng = np.random.default_rng(1)
    x = rng.standard_normal((STEPS * BATCH, 4)).astype(np.float32)
    y = (x @ np.arange(4, dtype=np.float32) + 0.5)[:, None]
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    def on_reset() -> None:
        log["sizes"].append(hvd.size())

    state.register_reset_callbacks([on_reset])

    class Die(tf.keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = state.epoch

        def on_batch_begin(self, batch, logs=None):
            if die_at == [self.epoch, batch]:
                write_log()
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_end(self, epoch, logs=None):
            log["epochs"].append(state.epoch)
            write_log()

    # Die last: its epoch-end log sees the state the elastic callbacks just updated.
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=1), Die()]

    @hvd.elastic.run
    def train(state) -> None:
        model.fit(x, y, batch_size=BATCH, steps_per_epoch=STEPS, epochs=EPOCHS - state.epoch,
                  callbacks=callbacks, verbose=0, shuffle=False)

    train(state)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    log["weights"] = hashlib.sha256(weights.tobytes()).hexdigest()
    log["final_epoch"] = state.epoch
    write_log()
    hvd.shutdown()


if __name__ == "__main__":
    main()
