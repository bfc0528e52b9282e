"""TensorFlow is optional: nothing but mpitrain.tensorflow may import it."""

import subprocess
import sys

from support import ROOT


def test_mpitrain_and_the_mxnet_style_api_never_import_tensorflow():
    code = ("import sys, mpitrain, mpitrain.kvstore, mpitrain.mxnet, mpitrain.torch\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('tensorflow', 'keras'))\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
