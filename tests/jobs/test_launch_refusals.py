"""Launched the wrong way, never silently alone: torchrun and a Slurm step without PMI fail on
every process with one message; plain python and mpirun are untouched.

Independent processes run side by side to keep the file cheap (~20 s on an idle 2-core machine).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support import ROOT, job_env, mpirun_command

TORCHRUN = Path(sys.executable).parent / "torchrun"

# How a user tries it: init, then report the world.  ``c10d`` goes through
# torch.distributed.init_process_group(backend="mpitrain"), ``dropin`` through the DDP drop-in's.
SCRIPT = """\
import sys
how = sys.argv[1] if len(sys.argv) > 1 else "hvd"
if how == "hvd":
    import mpitrain as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
elif how == "c10d":
    import torch.distributed as dist
    import mpitrain.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(backend="mpitrain")
    rank, size = dist.get_rank(), dist.get_world_size()
else:
    import mpitrain.torch.distributed as dist
    dist.init_process_group(backend="nccl")
    rank, size = dist.get_rank(), dist.get_world_size()
import os
print(f"TRAINING rank {rank} of {size} WORLD_SIZE={os.environ.get('WORLD_SIZE')}", flush=True)
"""

# Launcher variables a developer's shell might hold would change what the script sees.
_LAUNCHER_NOISE = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_ID",
                   "SLURM_STEPID", "SLURM_NTASKS", "SLURM_PROCID", "PMI_SIZE", "PMIX_RANK",
                   "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = job_env()
    for name in _LAUNCHER_NOISE:
        env.pop(name, None)
    env.update(extra or {})
    return env


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _run_side_by_side(commands: dict[str, tuple[list[str], dict[str, str]]],
                      timeout: float = 90) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run independent commands at once; a hang fails the test (and kills what is left)."""
    procs = {label: subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
             for label, (argv, env) in commands.items()}
    results = {}
    try:
        for label, proc in procs.items():
            out, err = proc.communicate(timeout=timeout)
            results[label] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    return results


def _full(launcher: str) -> str:
    return f"mpitrain: {launcher} started 2 processes ("


def _assert_no_traceback_through_mpitrain(err: str) -> None:
    assert "runtime.py" not in err and "launchers.py" not in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["hvd", "c10d"])
def test_torchrun_two_processes_fail_fast_with_the_message(script, how):
    # torchrun stops the other child once one has failed, so the second message may be cut
    # short by its SIGTERM; each message appears at most once and at least one does.
    result = subprocess.run([str(TORCHRUN), "--nproc_per_node", "2", "--monitor-interval", "1",
                             str(script), how],
                            env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=90)
    err = result.stderr
    assert result.returncode != 0, (result.stdout, err)
    assert "TRAINING" not in result.stdout
    full = err.count(_full("torchrun"))
    short = err.count("torchrun started 2 processes but MPI sees a world of one (rank 1 of 2)")
    assert full <= 1 and short <= 1 and full + short >= 1, err
    assert "mpitrainrun -np 2 " in err
    # torchrun's own failure summary names the reason, not "To enable traceback see ...".
    assert "torchrun started 2 processes but MPI sees a world of one; refused." in err, err
    _assert_no_traceback_through_mpitrain(err)


@pytest.mark.timeout(120)
def test_simulated_slurm_step_and_drop_in_refuse_on_every_process(script):
    def slurm(rank: int) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, str(script)], _env({
            "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})

    results = _run_side_by_side({
        "slurm0": slurm(0), "slurm1": slurm(1),
        # The DDP drop-in's init_process_group, under torchrun's variables.
        "dropin": ([sys.executable, str(script), "dropin"],
                   _env({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "localhost",
                         "MASTER_PORT": "29500"})),
    })
    for label, result in results.items():
        assert result.returncode == 1 and "TRAINING" not in result.stdout, (label, result)
        _assert_no_traceback_through_mpitrain(result.stderr)
    rank0, rank1 = results["slurm0"].stderr, results["slurm1"].stderr
    assert rank0.startswith(_full("a Slurm step (srun)")), rank0
    assert "srun --mpi=pmix -n 2 " in rank0 and "MPITRAIN_ALLOW_SINGLETON=1" in rank0
    assert rank1.count("\n") == 1 and "see rank 0's message" in rank1, rank1
    assert _full("a torch.distributed launcher (WORLD_SIZE/RANK)") in results["dropin"].stderr


@pytest.mark.timeout(120)
def test_plain_python_opt_out_and_mpirun_are_untouched(script):
    # Under mpirun -np 1, Open MPI's OMPI_COMM_WORLD_SIZE=1 is the nearest launcher: a world of
    # one is right although the surrounding (simulated) Slurm step and WORLD_SIZE say 4.
    outer = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
             "SLURM_PROCID": "0", "WORLD_SIZE": "4", "RANK": "0"}
    results = _run_side_by_side({
        "plain": ([sys.executable, str(script)], _env()),
        "opt-out": ([sys.executable, str(script)],
                    _env({"WORLD_SIZE": "2", "RANK": "1", "MPITRAIN_ALLOW_SINGLETON": "1"})),
        "mpirun": (mpirun_command(1, [sys.executable, str(script)]), _env(outer)),
    })
    # init() exports MPI's world for libraries (mpitrain.core.job_env): a world of one everywhere.
    expected = {"plain": "1", "opt-out": "1", "mpirun": "1"}
    for label, result in results.items():
        assert result.returncode == 0, (label, result.stderr)
        assert result.stdout.strip() == f"TRAINING rank 0 of 1 WORLD_SIZE={expected[label]}"
