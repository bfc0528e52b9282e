"""A Horovod TensorFlow 2 script as Horovod users write them (Keras 3 spelling): nothing in it
knows mpitrain.

``import horovod.tensorflow as hvd`` and ``horovod.tensorflow.keras`` run unchanged on mpitrain
through the compatibility route (``mpitrainrun --horovod-compat -np 2 python
tensorflow2_digits.py``), checked by tests/jobs/test_horovod_compat_scripts.py.  Part one is
Horovod's custom loop: a ``tf.function`` step with ``DistributedGradientTape``, variables
broadcast after the first step.  Part two is Horovod's Keras pattern: a wrapped optimizer and
the broadcast and metric-average callbacks in ``model.fit``.
"""

import argparse

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description="Horovod TensorFlow 2 digits example")
parser.add_argument("--steps", type=int, default=40)
args = parser.parse_args()

hvd.init()
tf.random.set_seed(1234)

digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
y = digits.target.astype(np.int64)
shard_x, shard_y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
dataset = (tf.data.Dataset.from_tensor_slices((shard_x, shard_y))
           .repeat().shuffle(1000, seed=hvd.rank()).batch(32))


def make_model():
    return tf.keras.Sequential([tf.keras.Input(shape=(64,)),
                                tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(10)])


# Part one: a custom training loop.
model = make_model()
loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
opt = tf.keras.optimizers.SGD(0.05 * hvd.size(), momentum=0.9)


@tf.function
def training_step(images, labels, first_batch):
    with tf.GradientTape() as tape:
        loss_value = loss(labels, model(images, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


for batch, (images, labels) in enumerate(dataset.take(args.steps)):
    loss_value = training_step(images, labels, batch == 0)
accuracy = float(np.mean(np.argmax(model(x).numpy(), axis=1) == y))
accuracy = float(hvd.allreduce(tf.constant(accuracy), name="accuracy"))
weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
gathered = hvd.allgather(tf.constant(weights[None, :])).numpy()
if hvd.rank() == 0:
    print(f"tape: ranks {hvd.size()} parameters identical "
          f"{bool((gathered == gathered[0]).all())} accuracy {accuracy:.3f}")

# Part two: Keras fit with Horovod's callbacks.
keras_model = make_model()
keras_model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)),
                    loss=loss, metrics=["accuracy"])
callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
             hvd_keras.callbacks.MetricAverageCallback()]
history = keras_model.fit(dataset, steps_per_epoch=args.steps // 2, epochs=2,
                          callbacks=callbacks, verbose=0)
weights = np.concatenate([v.numpy().ravel() for v in keras_model.trainable_variables])
gathered = hvd.allgather(tf.constant(weights[None, :])).numpy()
if hvd.rank() == 0:
    print(f"fit: ranks {hvd.size()} parameters identical "
          f"{bool((gathered == gathered[0]).all())} "
          f"accuracy {history.history['accuracy'][-1]:.3f}")
