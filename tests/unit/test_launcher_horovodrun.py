"""mpitrainrun as a horovodrun replacement: horovodrun's flags, and which Python the ranks run."""

import shlex
import sys
import textwrap

import pytest

from mpitrain.horovod_compat import SHIM_PATH
from mpitrain.runner import launch

BASE = {"PATH": "/usr/bin", "HOME": "/root"}
PY = shlex.quote(sys.executable)


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    monkeypatch.setattr(launch, "_cores", lambda: 8)
    monkeypatch.setattr(launch.os, "geteuid", lambda: 0)


def dry(capsys, argv, flavor="openmpi", environ=None):
    code = launch.main(["--dry-run", "--mpirun", "mpirun", *(["--mpi", flavor] if flavor else []),
                        *argv], environ=BASE if environ is None else environ)
    out, err = capsys.readouterr()
    return code, out.strip(), err.strip()


def test_a_bare_python_runs_the_launchers_interpreter(capsys):
    for name in ("python", "python3"):
        code, out, _ = dry(capsys, ["-np", "2", name, "train.py"])
        assert code == 0 and out.endswith(f" {PY} train.py"), out
    code, out, _ = dry(capsys, ["-np", "2", "/opt/py/bin/python", "train.py"])
    assert out.endswith(" /opt/py/bin/python train.py")  # a path is the user's choice
    code, out, _ = dry(capsys, ["-np", "2", "./run.sh"])
    assert out.endswith(" ./run.sh")


def test_the_note_names_both_interpreters_when_path_would_differ(tmp_path):
    other = tmp_path / "python"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    note = launch.python_note(["python", "t.py"], {"PATH": str(tmp_path)})
    assert note is not None and sys.executable in note and str(other) in note
    assert launch.python_note(["/usr/bin/python3", "t.py"], {"PATH": str(tmp_path)}) is None


def test_horovod_compat_puts_the_stand_in_first_on_the_ranks_path(capsys):
    code, out, _ = dry(capsys, ["-np", "2", "--horovod-compat", "python", "t.py"],
                       environ={**BASE, "PYTHONPATH": "/mine"})
    assert code == 0
    assert f"-x PYTHONPATH={SHIM_PATH}:/mine" in out
    assert " -x PYTHONPATH " not in out  # not forwarded a second time with the old value


@pytest.mark.parametrize(("flags", "openmpi"), [
    ("--output-filename /tmp/logs", "--output dir=/tmp/logs"),
    ("--prefix-output-with-timestamp", "--output timestamp"),
    ("-prefix-timestamp --output-filename /tmp/logs", "--output dir=/tmp/logs,timestamp"),
    ("-p 2222", "--prtemca plm_ssh_args '-p 2222'"),
    ("--ssh-port 2222 -i /k/id", "--prtemca plm_ssh_args '-p 2222 -i /k/id'"),
])
def test_output_and_ssh_flags_for_open_mpi(capsys, flags, openmpi):
    code, out, err = dry(capsys, ["-np", "2", *shlex.split(flags), "python", "t.py"])
    assert code == 0, err
    assert f" {openmpi} python" in out.replace(PY, "python")


def test_output_and_ssh_flags_for_mpich(capsys):
    code, out, _ = dry(capsys, ["-np", "2", "--output-filename", "/l", "-p", "22", "python",
                                "t.py"], flavor="mpich")
    assert code == 0
    assert "-outfile-pattern /l/rank.%r.stdout -errfile-pattern /l/rank.%r.stderr " \
           "-bootstrap-exec-args '-p 22'" in out
    code, _, err = dry(capsys, ["-np", "2", "--prefix-output-with-timestamp", "python", "t.py"],
                       flavor="mpich")
    assert code == 2 and "needs Open MPI" in err


def test_binding_args_replace_no_binding(capsys):
    _, out, _ = dry(capsys, ["-np", "2", "--binding-args=--bind-to core", "python", "t.py"])
    assert "--bind-to core --map-by slot" in out and "--bind-to none" not in out
    _, out, _ = dry(capsys, ["-np", "2", "--binding-args=--bind-to core --map-by ppr:1:node",
                             "python", "t.py"])
    assert "--map-by slot" not in out and "--map-by ppr:1:node" in out


def test_horovodruns_bare_mpi_and_gloo_are_accepted_with_a_note(capsys):
    code, out, err = dry(capsys, ["--mpi", "-np", "2", "python", "t.py"])  # after --mpi openmpi
    assert code == 0 and out.startswith("mpirun -np 2")
    code, out, err = dry(capsys, ["-np", "2", "--gloo", "python", "t.py"])
    assert code == 0 and "--gloo: mpitrain runs over MPI only" in err
    # A command's own --mpi flag is the command's, not ours.
    code, out, _ = dry(capsys, ["-np", "2", "python", "t.py", "--mpi"])
    assert out.endswith("t.py --mpi")


def test_check_build_short_flag(capsys):
    assert "-cb" in launch.build_parser().format_help()


def _config(tmp_path, text):
    path = tmp_path / "hvd.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_config_file_fills_options_and_the_command_line_wins(capsys, tmp_path):
    path = _config(tmp_path, """\
        params:
          fusion_threshold_mb: 32
          cycle_time_ms: 5
          hierarchical_allgather: true
        timeline:
          filename: /tmp/tl.json
        stall_check:
          enabled: false
        logging:
          level: debug
        """)
    code, out, err = dry(capsys, ["-np", "2", "--config-file", path, "--cycle-time-ms", "2",
                                  "python", "t.py"])
    assert code == 0, err
    assert f"MPITRAIN_FUSION_THRESHOLD={32 * 1024 * 1024}" in out
    assert "MPITRAIN_CYCLE_TIME=2 " in out  # the command line's value, not the file's
    assert "MPITRAIN_TIMELINE=/tmp/tl.json" in out
    assert "MPITRAIN_STALL_CHECK_DISABLE=1" in out
    assert "MPITRAIN_LOG_LEVEL=DEBUG" in out
    assert "params.hierarchical_allgather has no meaning in mpitrain" in err


@pytest.mark.parametrize(("text", "message"), [
    ("parms:\n  cycle_time_ms: 1\n", "unknown section 'parms'"),
    ("params:\n  cycle: 1\n", "unknown key params.cycle"),
    ("params:\n  cycle_time_ms: -1\n", "params.cycle_time_ms: -1 is not a valid value"),
    ("params:\n  cache_capacity: lots\n", "params.cache_capacity: 'lots' is not a valid value"),
    ("controller: nccl\n", "controller 'nccl' is neither mpi nor gloo"),
    ("[1, 2]\n", "expected a mapping"),
])
def test_config_file_errors_name_the_value(capsys, tmp_path, text, message):
    code, _, err = dry(capsys, ["-np", "2", "--config-file", _config(tmp_path, text), "python",
                                "t.py"])
    assert code == 2 and message in err, err


def test_a_missing_config_file_is_named(capsys, tmp_path):
    code, _, err = dry(capsys, ["-np", "2", "--config-file", str(tmp_path / "nope.yaml"),
                                "python", "t.py"])
    assert code == 2 and "nope.yaml" in err


def test_open_mpi_ending_the_job_over_a_lost_node_is_no_success(tmp_path, capfd, monkeypatch):
    # Open MPI 5.0.11 prints this and exits 0 when a node's daemon is lost, though the ranks
    # never finished: mpitrainrun must report failure (the output still gets through).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")  # the script must exist: it is checked before launch
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'rank output'\n"
                    "echo 'PRTE has lost communication with a remote daemon.' >&2\nexit 0\n")
    fake.chmod(0o755)
    code = launch.main(["--mpirun", str(fake), "--mpi", "openmpi", "-np", "2", "python", "t.py"],
                       environ=BASE)
    out, err = capfd.readouterr()
    assert code == 1
    assert "rank output" in out and "PRTE has lost communication" in err
    assert "Open MPI lost a node's daemon" in err
    fake.write_text("#!/bin/sh\necho 'fine' >&2\nexit 0\n")
    assert launch.main(["--mpirun", str(fake), "--mpi", "openmpi", "-np", "2", "python",
                        "t.py"], environ=BASE) == 0


def test_a_missing_script_is_named_once_before_anything_starts(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = launch.main(["-np", "2", "--mpirun", "mpirun", "--mpi", "openmpi", "python",
                        "nosuch.py"], environ=BASE)
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("nosuch.py: no such file") == 1 and str(tmp_path) in err


@pytest.mark.parametrize(("command", "missing"), [
    (["python", "nosuch.py", "--lr", "1"], True),
    (["/opt/venv/bin/python3.11", "-u", "-X", "dev", "nosuch.py"], True),
    (["python", "-m", "mpitrain.horovod_compat", "nosuch.py"], False),
    (["python", "-c", "print(1)"], False),
    (["python", "--version"], False),
    (["./train.sh", "nosuch.py"], False),
    (["python", "here.py"], False),
])
def test_which_commands_name_a_missing_script(tmp_path, command, missing):
    (tmp_path / "here.py").write_text("")
    assert (launch.missing_script(command, str(tmp_path)) is not None) == missing


def test_only_jobs_on_this_machine_check_the_script():
    parser = launch.build_parser()
    for hosts, local in ((None, True), ("localhost:2", True), ("node1:1,node2:1", False)):
        args = parser.parse_args(["-np", "2", *(["-H", hosts] if hosts else []), "python",
                                  "t.py"])
        plan = launch.make_plan(args, BASE, launch.Flavor.OPENMPI, "mpirun", 8, True)
        assert plan.local_only is local, hosts
