"""The SyncBatchNorm CNN and the torch.distributed script of examples/pytorch, as whole jobs."""

import re
import sys

from support import ROOT, run_job

EXAMPLES = ROOT / "examples" / "pytorch"


def test_torch_distributed_script_same_losses_on_mpitrain_and_gloo():
    losses = {}
    for backend in ("mpitrain", "gloo"):
        result = run_job(2, [sys.executable, str(EXAMPLES / "torch_distributed_ddp.py"),
                             "--backend", backend, "--epochs", "2"], timeout=180)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"({backend}, 2 ranks)" in result.stdout
        losses[backend] = re.findall(r"mean loss ([0-9.]+)", result.stdout)
        assert len(losses[backend]) == 2
    assert losses["mpitrain"] == losses["gloo"]


def test_sync_bn_cnn_local_scope_on_two_emulated_nodes():
    argv = [sys.executable, str(EXAMPLES / "sync_bn_cnn.py"), "--sync-bn-scope", "local",
            "--epochs", "1", "--batch-size", "32"]
    result = run_job(4, argv, env={"MPITRAIN_LOCAL_SIZE": "2"}, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", result.stdout).group(1))
    assert "sync-bn scope: local, 4 ranks" in result.stdout
    assert accuracy > 0.8
