"""Every example of examples/tensorflow_style and examples/mxnet_style, briefly, on 2 ranks.

Each must exit cleanly, report a test accuracy above chance by far, and leave rank 0's
checkpoint behind.  The TensorFlow ones are skipped when TensorFlow is not installed.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from support import ROOT, run_job


def _has_tensorflow() -> bool:
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as none
        return False


HAS_TF = _has_tensorflow()
needs_tf = pytest.mark.skipif(not HAS_TF, reason="needs pip install 'mpitrain[tensorflow]'")

# (script, brief arguments, a file rank 0's checkpoint must leave, extra environment)
EXAMPLES = [
    pytest.param("tensorflow_style/tf2_custom_loop.py", ["--epochs", "4"], "model.weights.h5",
                 {}, marks=needs_tf, id="tf2_custom_loop"),
    pytest.param("tensorflow_style/keras_fit.py", ["--epochs", "4"], "model.weights.h5", {},
                 marks=needs_tf, id="keras_fit"),
    pytest.param("mxnet_style/kvstore_numpy_mlp.py", ["--epochs", "5"], "params.npz", {},
                 id="kvstore_numpy_mlp"),
    pytest.param("mxnet_style/kvstore_numpy_mlp.py",
                 ["--epochs", "5", "--gradient-compression", "2bit"], "optimizer.states", {},
                 id="kvstore_numpy_mlp-2bit"),
    pytest.param("mxnet_style/kvstore_numpy_mlp.py",
                 ["--epochs", "5", "--gradient-compression", "onebit"], "params.npz", {},
                 id="kvstore_numpy_mlp-onebit"),
    pytest.param("pytorch/train_digits.py", ["--epochs", "6", "--compression", "powersgd",
                                             "--no-progress"], "epoch-006.pt", {},
                 id="train_digits-powersgd"),
    pytest.param("mxnet_style/kvstore_pushpull_local_optimizer.py", ["--epochs", "4"],
                 "checkpoint.pt", {}, id="kvstore_pushpull_local_optimizer"),
    pytest.param("mxnet_style/gluon_trainer.py", ["--epochs", "4", "--horovod"],
                 "trainer.states", {}, id="gluon_trainer-horovod"),
    pytest.param("mxnet_style/sync_batchnorm.py", ["--epochs", "6", "--comm-scope", "global"],
                 "model.pt", {}, id="sync_batchnorm-global"),
    # Two emulated nodes of one rank each, so that "local" is not "global".
    pytest.param("mxnet_style/sync_batchnorm.py", ["--epochs", "6", "--comm-scope", "local"],
                 "model.pt", {"MPITRAIN_LOCAL_SIZE": "1"}, id="sync_batchnorm-local"),
]


def run_example(script: str, args: list[str], checkpoint_dir: Path,
                env: dict[str, str] | None = None) -> tuple[str, float]:
    argv = [sys.executable, str(ROOT / "examples" / script), *args,
            "--checkpoint-dir", str(checkpoint_dir)]
    result = run_job(2, argv, env={"TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})}, timeout=300)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-5000:]}"
    found = re.findall(r"accuracy (\d\.\d+)", result.stdout)
    assert found, f"{script} reported no accuracy:\n{result.stdout[-3000:]}"
    return result.stdout, float(found[-1])


@pytest.mark.parametrize(("script", "args", "artifact", "env"), EXAMPLES)
def test_example_trains_on_two_ranks(script, args, artifact, env, tmp_path):
    stdout, accuracy = run_example(script, args, tmp_path, env)
    print(f"{script} {' '.join(args)}: accuracy {accuracy:.4f}")
    assert accuracy > 0.85, stdout[-3000:]
    assert (tmp_path / artifact).exists(), sorted(p.name for p in tmp_path.iterdir())


def test_gluon_trainer_trains_and_resumes_from_rank0_checkpoint(tmp_path):
    run_example("mxnet_style/gluon_trainer.py", ["--epochs", "2"], tmp_path)
    stdout, accuracy = run_example("mxnet_style/gluon_trainer.py", ["--epochs", "4"], tmp_path)
    print(f"mxnet_style/gluon_trainer.py --epochs 2, then 4: accuracy {accuracy:.4f}")
    assert "resumed after epoch 2" in stdout and "epoch 4/4" in stdout
    assert "epoch 1/4" not in stdout
    assert accuracy > 0.85
    assert (tmp_path / "trainer.states").exists() and (tmp_path / "model.pt").exists()


@needs_tf
def test_compat_v1_session_trains_and_resumes_from_rank0_checkpoint(tmp_path):
    script = "tensorflow_style/compat_v1_monitored_session.py"
    run_example(script, ["--steps", "200"], tmp_path)
    stdout, accuracy = run_example(script, ["--steps", "300"], tmp_path)
    print(f"{script} --steps 200, then 300: accuracy {accuracy:.4f}")
    assert "starting at global step 200" in stdout
    assert accuracy > 0.85
    assert (tmp_path / "checkpoint").exists()
