"""Which launcher started this process, and the refusal of a world of one that should be more."""

from __future__ import annotations

import pytest

from mpitrain.core import config, launchers
from mpitrain.core.errors import MpitrainInternalError

OPEN_MPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
MPICH = "MPICH Version:      4.2.0"

TORCHRUN = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def test_no_launcher_is_a_world_of_one():
    assert launchers.detect({}) is None
    assert launchers.detect({"PATH": "/usr/bin", "HOME": "/root"}) is None
    launchers.check_world(1, False, OPEN_MPI, environ={})


def test_torchrun_is_detected_with_its_rank():
    claim = launchers.detect(TORCHRUN)
    assert claim is not None
    assert (claim.name, claim.size, claim.rank) == ("torchrun", 2, 1)
    assert "WORLD_SIZE=2" in claim.evidence and "RANK=1" in claim.evidence
    generic = launchers.detect({"WORLD_SIZE": "4", "RANK": "0"})
    assert generic is not None and generic.size == 4 and "WORLD_SIZE/RANK" in generic.name
    # torchrun with one process: a world of one is right.
    assert launchers.detect({**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0",
                             "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}) is None


def test_slurm_counts_only_inside_a_task_step():
    claim = launchers.detect(SLURM_STEP)
    assert claim is not None and (claim.size, claim.rank) == (2, 0)
    # The step's own count beats the allocation's.
    assert launchers.detect({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "1"}) is None
    # The batch script (step 4294967294), the extern step, and salloc's shell (no step) are not
    # parallel steps: `python train.py` there is a world of one.
    for step in ("4294967294", "4294967295", "batch"):
        assert launchers.detect({**SLURM_STEP, "SLURM_STEP_ID": step}) is None
    no_step = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    assert launchers.detect(no_step) is None
    legacy = {**no_step, "SLURM_STEPID": "3"}
    assert launchers.detect(legacy) is not None


def test_innermost_launcher_decides():
    # mpirun -np 1 inside a Slurm step of 4 (Open MPI's daemons are srun tasks): one is right.
    assert launchers.detect({**SLURM_STEP, "SLURM_NTASKS": "4",
                             "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) is None
    # srun starts one torchrun per node; torchrun's world is the job.
    claim = launchers.detect({**SLURM_STEP, **TORCHRUN, "WORLD_SIZE": "8"})
    assert claim is not None and (claim.name, claim.size) == ("torchrun", 8)


def test_rank_only_launchers_defer_to_a_size_or_prove_one():
    assert launchers.detect({"PMIX_RANK": "0"}) is None
    claim = launchers.detect({"PMIX_RANK": "3"})
    assert claim is not None and (claim.size, claim.rank) == (4, 3)
    # srun --mpi=pmix with a library that does not speak PMIx: Slurm says how many.
    claim = launchers.detect({**SLURM_STEP, "SLURM_NTASKS": "6", "PMIX_RANK": "0"})
    assert claim is not None and claim.size == 6 and claim.launcher.kind == "slurm"


def test_mpi_launchers_of_another_library():
    claim = launchers.detect({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    assert claim is not None and claim.launcher.kind == "mpi"
    hydra = launchers.detect({"PMI_SIZE": "3", "PMI_RANK": "2", "MPI_LOCALNRANKS": "3"})
    assert hydra is not None and (hydra.size, hydra.rank) == (3, 2)
    local_only = launchers.detect({"MPI_LOCALNRANKS": "2"})
    assert local_only is not None and local_only.size == 2
    # A variable that does not parse is no evidence.
    assert launchers.detect({"OMPI_COMM_WORLD_SIZE": "many"}) is None


def test_refusal_names_detection_reason_and_commands():
    env = {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"}
    argv = ["/venv/bin/python", "-u", "train.py", "--lr", "0.1"]
    with pytest.raises(launchers.LauncherMismatchError) as info:
        launchers.check_world(1, False, OPEN_MPI, environ=env, argv=argv)
    text = str(info.value)
    assert isinstance(info.value, MpitrainInternalError)
    assert "torchrun started 2 processes (WORLD_SIZE=2" in text
    assert "not MPI" in text
    assert "mpitrainrun -np 2 /venv/bin/python -u train.py --lr 0.1" in text
    assert "mpirun -np 2 /venv/bin/python -u train.py --lr 0.1" in text
    assert "MPITRAIN_ALLOW_SINGLETON=1" in text
    assert info.value.printed == text  # the launcher's rank 0 prints it all
    # Where torchrun is all the scheduler runs: the rendezvous launch, in its spelling.
    assert ("mpitrainrun --nnodes 1 --nproc-per-node 2 --rdzv-endpoint HOST:PORT "
            "/venv/bin/python -u train.py --lr 0.1") in text
    assert "docs/guide/rendezvous.md" in text


def test_torchrun_refusal_sizes_the_rendezvous_from_torchruns_variables():
    env = {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0",
           "TORCHELASTIC_RUN_ID": "100"}
    with pytest.raises(launchers.LauncherMismatchError) as info:
        launchers.check_world(1, False, OPEN_MPI, environ=env, argv=["python", "t.py"])
    assert "mpitrainrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:PORT python t.py" \
        in str(info.value)
    # Without a local size that divides the world, the numbers are left to the user.
    env = {"WORLD_SIZE": "6", "RANK": "0", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    with pytest.raises(launchers.LauncherMismatchError) as info:
        launchers.check_world(1, False, OPEN_MPI, environ=env, argv=["python", "t.py"])
    assert "mpitrainrun --nnodes N --nproc-per-node K --rdzv-endpoint" in str(info.value)


def test_other_ranks_print_one_line():
    with pytest.raises(launchers.LauncherMismatchError) as info:
        launchers.check_world(1, False, OPEN_MPI, environ=TORCHRUN, argv=["python", "t.py"])
    printed = info.value.printed
    assert "\n" not in printed and "rank 1 of 2" in printed
    assert "mpitrainrun -np 2 python t.py" in printed
    assert "MPITRAIN_ALLOW_SINGLETON" in str(info.value)


@pytest.mark.parametrize(("library", "plugin", "mpirun"),
                         [(OPEN_MPI, "pmix", "mpirun -np 2"), (MPICH, "pmi2", "mpiexec -n 2")])
def test_slurm_advice_follows_the_library(library, plugin, mpirun):
    message = launchers.explain(launchers.detect(SLURM_STEP), library, ["python", "t.py"]).message
    assert f"srun --mpi={plugin} -n 2 python t.py" in message
    message = launchers.explain(launchers.detect({"PMI_SIZE": "2", "PMI_RANK": "0"}),
                                library, ["python", "t.py"]).message
    assert f"{mpirun} python t.py" in message
    assert f"mpi4py loaded {launchers.library_name(library)}." in message


def test_a_real_world_or_the_opt_out_pass():
    launchers.check_world(2, False, OPEN_MPI, environ=TORCHRUN)
    launchers.check_world(1, True, OPEN_MPI, environ=TORCHRUN)


def test_opt_out_is_a_documented_setting():
    assert config.load({"MPITRAIN_ALLOW_SINGLETON": "1"}).allow_singleton is True
    assert config.load({}).allow_singleton is False
    assert any(name == launchers.ALLOW_VARIABLE for name, _, _ in config.describe())


def test_long_commands_are_shortened():
    message = launchers.explain(launchers.detect(TORCHRUN), OPEN_MPI,
                                ["python", "-c", "x = 1;" * 100]).message
    assert "mpitrainrun -np 2 python train.py" in message


def test_srun_with_the_wrong_pmi_plugin_points_to_the_right_one():
    # srun --mpi=pmi2 with Open MPI: the PMI variables decide, the advice stays srun's.
    env = {**SLURM_STEP, "PMI_SIZE": "2", "PMI_RANK": "0", "PMI_FD": "5"}
    claim = launchers.detect(env)
    assert claim is not None and claim.launcher.kind == "mpi" and claim.in_slurm_step
    message = launchers.explain(claim, OPEN_MPI, ["python", "t.py"]).message
    assert "srun --mpi=pmix -n 2 python t.py" in message
    assert "mpirun -np 2" not in message


def test_library_names_are_short():
    assert launchers.library_name(OPEN_MPI) == "Open MPI v5.0.11"
    assert launchers.library_name(MPICH + "\nMPICH Release date: ...") == "MPICH 4.2.0"
    assert launchers.library_name("") == "an MPI library"


def test_torchrun_summary_gets_the_reason(tmp_path, monkeypatch):
    import json

    with pytest.raises(launchers.LauncherMismatchError) as info:
        launchers.check_world(1, False, OPEN_MPI, environ=TORCHRUN, argv=["python", "t.py"])
    assert info.value.headline == ("mpitrain: torchrun started 2 processes but MPI sees a world "
                                   "of one; refused. Launch with: mpitrainrun -np 2 python t.py")
    reply = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(reply))
    launchers._report_to_torchrun(info.value.headline)
    assert json.loads(reply.read_text())["message"] == info.value.headline
    reply.write_text("{}")  # torch's own handler wrote first: left alone
    launchers._report_to_torchrun("other")
    assert reply.read_text() == "{}"
