"""The documentation site: it builds in strict mode, every snippet compiles, marked ones run.

``mkdocs build --strict`` fails on any warning: a broken link or anchor, a page missing from
the navigation, a docstring mkdocstrings cannot read, a generated part that cannot be made
(tools/docs/hooks.py: the configuration reference, the Horovod tables, the plots).  The
markers a block can carry are described in tools/docs/snippets.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from support import ROOT, run_command, run_job

sys.path.insert(0, str(ROOT / "tools" / "docs"))
import snippets  # noqa: E402 - tools/docs is not a package

ALL_BLOCKS = [b for path in snippets.documentation_files() for b in snippets.blocks(path)]
PYTHON = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not installed: pip install -e '.[docs]'"
        if os.environ.get("MPITRAIN_TEST_REQUIRE_DOCS") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.timeout(600)
def test_the_site_builds_in_strict_mode(tmp_path):
    _require("mkdocs")
    _require("matplotlib")
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    reference = (site / "reference" / "configuration" / "index.html").read_text()
    assert "MPITRAIN_FUSION_THRESHOLD" in reference and "HOROVOD_FUSION_THRESHOLD" in reference
    migrating = (site / "migrating-from-horovod" / "index.html").read_text()
    assert "--start-timeout" in migrating and "DistributedOptimizer" in migrating
    for plot in ("allreduce-bandwidth", "multinode-time", "compression-time-to-accuracy",
                 "gpu-kernel-throughput"):
        assert (site / "images" / f"{plot}.svg").stat().st_size > 1000, plot
    assert "<!-- generated:" not in "".join(p.read_text() for p in site.rglob("*.html"))


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_every_python_snippet_compiles(block):
    compile(block.text, block.where, "exec")


def test_markers_say_something_the_tests_do():
    for block in ALL_BLOCKS:
        if block.action == "skip":
            assert block.lang in snippets.SHELLS and block.argument, \
                f"{block.where}: a skip marks a shell block and gives its reason"
        if block.action == "run":
            assert block.lang in ("python", "py"), f"{block.where}: only python blocks run"
    assert [b for b in PYTHON if b.action == "run"], "no runnable snippet left"


RUNNABLE = [b for b in PYTHON if b.action == "run"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_snippets_run(block, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(block.text)
    argv = [sys.executable, str(script)]
    result = (run_job(block.np, argv, timeout=240, cwd=tmp_path) if block.np > 1
              else run_command(argv, timeout=240, cwd=tmp_path))
    assert result.returncode == 0, (f"{block.where}:\n{result.stdout[-2000:]}\n"
                                    f"{result.stderr[-3000:]}")
