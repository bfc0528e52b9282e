"""torch.distributed's env:// rendezvous under mpirun after ``hvd.init()``, whenever torch loads.

``init()`` exports RANK/WORLD_SIZE, so torch-based libraries (Trainer, Accelerate) call
``init_process_group()`` through env://, which also wants MASTER_ADDR/MASTER_PORT.  mpitrain
supplies them from MPI; since ``import mpitrain`` no longer imports torch, that must hold both
when torch was loaded before ``init()`` and when the program imports it after (CI once caught
Trainer failing with "MASTER_ADDR expected, but not set").
"""

import sys

import pytest

from support import run_job

pytest.importorskip("torch")

TORCH_FIRST = "import torch\nimport mpitrain as hvd\nhvd.init()\n"
INIT_FIRST = ("import mpitrain as hvd\nhvd.init()\n"
              "assert 'torch' not in __import__('sys').modules\nimport torch\n")
GLOO_GROUP = """
import torch.distributed as dist
dist.init_process_group("gloo")  # env:// with only what mpitrain exported
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"RESULT rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("order", ["torch-first", "init-first"])
def test_env_rendezvous_after_init_whenever_torch_loads(order):
    head = TORCH_FIRST if order == "torch-first" else INIT_FIRST
    result = run_job(2, [sys.executable, "-c", head + GLOO_GROUP], timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.stdout.split("RESULT")[1:]) == [
        " rank=0 world=2 sum=3\n", " rank=1 world=2 sum=3\n"], result.stdout
