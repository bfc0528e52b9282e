"""Accelerate's DDP communication hooks over the mpitrain torch backend, as users enable them.

``DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD)`` makes
Accelerate register torch's own ``powerSGD_hook`` on torch's DDP; with
``init_process_group("mpitrain")`` its collectives are mpitrain's.  That hung every rank until
the backend stopped running future callbacks on the thread that completes futures (the hook
waits for one allreduce inside another's callback).  Two ranks: every order of summation
gives the same bits, so the run must equal Accelerate's own Gloo route exactly.
"""

import re
import sys

import pytest

from support import ROOT, run_job

pytest.importorskip("accelerate")

SCRIPT = str(ROOT / "tests" / "jobs" / "accelerate_comm_hook.py")
LINE = re.compile(r"RESULT rank=(\d+) world=(\d+) ddp=(\w+) hook_iter=(-?\d+) sha=(\w+)")


def _train(route: str, hook: str) -> list[tuple[str, ...]]:
    env = {"MASTER_ADDR": "127.0.0.1"} if route == "gloo" else {}  # Accelerate's route needs it
    result = run_job(2, [sys.executable, SCRIPT, route, hook], env=env, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = LINE.findall(result.stdout)
    assert sorted(r[0] for r in rows) == ["0", "1"], result.stdout[-2000:]
    return rows


@pytest.mark.timeout(600)
def test_accelerate_power_sgd_hook_over_mpitrain_equals_gloo():
    mine, gloo = _train("mpitrain", "power_sgd"), _train("gloo", "power_sgd")
    for rows in (mine, gloo):
        assert {r[1] for r in rows} == {"2"}, "Accelerate saw the wrong world size"
        assert {r[2] for r in rows} == {"DistributedDataParallel"}
        assert {r[3] for r in rows} == {"6"}, "the PowerSGD state did not see every step"
    assert {r[4] for r in mine} == {r[4] for r in gloo} and len({r[4] for r in mine}) == 1
