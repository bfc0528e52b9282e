"""Horovod 0.28.1's ``examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py`` on
mpitrain, with only the edits Keras 3 and this machine force, each listed in ``EDITS`` with why.

The script is read from a Horovod checkout (``MPITRAIN_HOROVOD_EXAMPLES`` points at its
``examples`` directory, as for the other Horovod-example tests; without it the test skips),
edited in memory and run under ``mpirun -np 2``: ``hvd.elastic.run`` around ``model.fit`` with
``KerasState`` and Horovod's three elastic callbacks, a rank-0 ModelCheckpoint, the optimizer
wrapped as the example wraps it.  With ULFM, a second run kills world rank 2 of 3 once an epoch
has been committed and the survivors must finish.  About a minute on a 2-core machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support import has_ulfm, job_env, mpirun_command, run_job

EXAMPLES = os.environ.get("MPITRAIN_HOROVOD_EXAMPLES", "")
SCRIPT = Path(EXAMPLES, "elastic", "tensorflow2", "tensorflow2_keras_mnist_elastic.py")

pytestmark = [
    pytest.mark.skipif(not (EXAMPLES and SCRIPT.is_file()),
                       reason="set MPITRAIN_HOROVOD_EXAMPLES to a Horovod 0.28.1 examples/ "
                              "directory"),
    pytest.mark.timeout(400),
]

# (Horovod's text, the replacement, why).  Each must occur exactly once in the script.
EDITS = [
    ("import horovod.tensorflow.keras as hvd",
     "import mpitrain.tensorflow.keras as hvd",
     "no `horovod` package here (issue 34 ships the shim that makes this edit unnecessary)"),
    ("(mnist_images, mnist_labels), _ = \\\n"
     "    tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())",
     "from sklearn.datasets import load_digits\n"
     "mnist_images, mnist_labels = load_digits(return_X_y=True)\n"
     "mnist_images = (mnist_images.reshape(-1, 8, 8) * 16).astype('uint8')",
     "no network to download MNIST: scikit-learn's 8x8 digits, scaled to MNIST's 0-255"),
    (",\n                    experimental_run_tf_function=False)",
     ")",
     "Keras 3's compile() has no experimental_run_tf_function (a TypeError)"),
    ("tf.keras.backend.set_value(state.model.optimizer.lr,  0.001 * hvd.size())",
     "state.model.optimizer.learning_rate.assign(0.001 * hvd.size())",
     "Keras 3 optimizers have no .lr and Keras 3 no backend.set_value"),
    ("tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.h5')",
     "tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.weights.h5', "
     "save_weights_only=True)",
     "Keras 3 saves whole models as .keras and weights as .weights.h5 only"),
    ("steps_per_epoch=500 // hvd.size(),\n                    epochs=24-state.epoch",
     "steps_per_epoch=int(os.environ['STEPS']),\n                    epochs=3-state.epoch",
     "CI time: 3 epochs of a few steps instead of 24 of 500"),
    ("import argparse\n", "import argparse\nimport os\n", "the step count comes from STEPS"),
]


def _edited(tmp_path: Path) -> Path:
    text = SCRIPT.read_text()
    for old, new, why in EDITS:
        assert text.count(old) == 1, f"Horovod's example changed; cannot apply: {why}"
        text = text.replace(old, new)
    path = tmp_path / SCRIPT.name
    path.write_text(text)
    return path


def _env(steps: int) -> dict[str, str]:
    return {"STEPS": str(steps), "TF_CPP_MIN_LOG_LEVEL": "3"}


def test_keras_elastic_example_trains_on_every_rank(tmp_path):
    script = _edited(tmp_path)
    result = run_job(2, [sys.executable, str(script)], env=_env(4), timeout=300, cwd=tmp_path)
    report = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    assert result.returncode == 0, report
    assert "Epoch 3/3" in result.stdout, report
    # Rank 0 alone writes the checkpoints (the example's own rule).
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.weights.h5")) == \
        [f"checkpoint-{e}.weights.h5" for e in (1, 2, 3)], report


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of the Python process below ``root`` whose MPI world rank is ``rank``."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry))
        except OSError:
            continue
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if f"OMPI_COMM_WORLD_RANK={rank}\0".encode() in env and b"python" in cmdline:
                return pid
    return None


@pytest.mark.skipif(not has_ulfm(), reason="needs Open MPI with ULFM (mpirun --with-ft ulfm)")
def test_keras_elastic_example_survives_losing_a_rank(tmp_path):
    script = _edited(tmp_path)
    cmd = mpirun_command(3, ["--with-ft", "ulfm", sys.executable, str(script)])
    proc = subprocess.Popen(cmd, env=job_env(_env(8)), cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(300, proc.kill)  # a hang fails the test instead of blocking it
    watchdog.start()
    lines: list[str] = []
    killed = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if killed is None and "Epoch 2/" in line:  # epoch 1 committed
                killed = _rank_pid(proc.pid, 2)
                assert killed is not None, "world rank 2 not found below mpirun"
                os.kill(killed, signal.SIGKILL)
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait()
    finally:
        watchdog.cancel()
    out = "".join(lines)
    report = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    assert killed is not None, report
    assert proc.returncode == 0, report
    assert "lost world rank(s) [2]" in err, report
    # After the reset the survivors fit the epochs left from the committed state
    # (epochs=3-state.epoch), so Keras counts them anew out of fewer than 3.
    after = out.split("Epoch 2/3", 1)[-1]
    assert re.search(r"Epoch \d/[12]\b", after), report
