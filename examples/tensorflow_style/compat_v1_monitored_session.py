"""Train a small MLP on scikit-learn's digits in a tf.compat.v1 graph with MonitoredTrainingSession.

Launch (2 ranks; drop --allow-run-as-root unless you are root, --oversubscribe unless you
have fewer cores than ranks):

    mpirun --allow-run-as-root --oversubscribe -np 2 \\
        python examples/tensorflow_style/compat_v1_monitored_session.py
    python examples/tensorflow_style/compat_v1_monitored_session.py   # a world of one

Run it again with the same ``--checkpoint-dir`` and it resumes: only rank 0 passes
``checkpoint_dir`` to the session (so only rank 0 restores and saves), and
``hvd.BroadcastGlobalVariablesHook(0)`` copies rank 0's variables, ``global_step`` included,
to the others once the session is up.  The optimizer is wrapped in
``hvd.DistributedOptimizer``, whose ``compute_gradients`` averages all gradients of a step in
one fused op; the learning rate is scaled by the number of ranks.  Needs
``pip install 'mpitrain[tensorflow,examples]'``.
"""

from __future__ import annotations

import argparse
import sys

try:
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
    p.add_argument("--steps", type=int, default=600, help="global steps to train to")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default="checkpoints/compat_v1_monitored_session")
    return p.parse_args()


def dense(x: tf.Tensor, units: int, name: str, seed: int) -> tf.Tensor:
    w = tf.compat.v1.get_variable(
        f"{name}/kernel", [x.shape[1], units],
        initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))
    b = tf.compat.v1.get_variable(f"{name}/bias", [units],
                                  initializer=tf.compat.v1.zeros_initializer())
    return tf.matmul(x, w) + b


def main() -> None:
    args = parse_args()
    hvd.init()
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y.astype(np.int64), test_size=0.2, random_state=0)
    shard_x, shard_y = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    rng = np.random.default_rng(args.seed + hvd.rank())

    with tf.Graph().as_default():
        images = tf.compat.v1.placeholder(tf.float32, [None, 64], name="images")
        labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
        seed = args.seed + hvd.rank()  # different on purpose: the hook makes them equal
        hidden = tf.nn.relu(dense(images, 64, "hidden", seed))
        logits = dense(hidden, 10, "logits", seed + 1000)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.int64))

        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.MomentumOptimizer(args.lr * hvd.size(), momentum=0.9)
        opt = hvd.DistributedOptimizer(opt)
        train_op = opt.minimize(loss, global_step=global_step)

        hooks = [hvd.BroadcastGlobalVariablesHook(0),
                 tf.compat.v1.train.StopAtStepHook(last_step=args.steps)]
        # Only rank 0 restores and writes checkpoints; the hook hands its state to the rest.
        checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None
        test_feed = {images: x_test[hvd.rank()::hvd.size()],
                     labels: y_test[hvd.rank()::hvd.size()]}
        final = tf.compat.v1.train.FinalOpsHook(correct, final_ops_feed_dict=test_feed)
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir, hooks=hooks + [final],
                save_checkpoint_steps=100, save_summaries_steps=None,
                log_step_count_steps=None) as sess:
            start = sess.run(global_step)
            if hvd.rank() == 0:
                print(f"starting at global step {start}", flush=True)
            while not sess.should_stop():
                idx = rng.choice(len(shard_x), args.batch_size, replace=False)
                _, value = sess.run([train_op, loss],
                                    feed_dict={images: shard_x[idx], labels: shard_y[idx]})
                step = sess.run(global_step) if not sess.should_stop() else args.steps
                if hvd.rank() == 0 and step % 100 == 0:
                    print(f"step {step} loss {value:.4f} (rank 0's batch)", flush=True)

    totals = hvd.allreduce(np.array([final.final_ops_values, len(test_feed[labels])], np.int64),
                           op=hvd.Sum).numpy()
    if hvd.rank() == 0:
        print(f"trained to global step {args.steps}: test accuracy {totals[0] / totals[1]:.4f} "
              f"(checkpoints in {args.checkpoint_dir})", flush=True)


if __name__ == "__main__":
    main()
