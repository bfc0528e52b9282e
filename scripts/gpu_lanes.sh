#!/usr/bin/env bash
# scripts/gpu_check.sh's test parts in three lanes at once, then the benchmarks alone while time
# is left: what fits a 15-minute GPU lease (one call of at most 10 minutes).
#
#   WHEELS=.whl bash scripts/gpu_lanes.sh          # on the lent machine; results in ./gpu_check/
#   BENCH_BEFORE=330 ...                           # start the benchmarks only this many
#                                                  # seconds into the run (default 330)
#
# The lanes share one GPU (tests only: nothing timed runs beside them). The benchmarks run after
# the lanes, alone, each step cut at STEP_TIMEOUT (default 60 s).
set -uo pipefail
cd "$(dirname "$0")/.."
CHECK=scripts/gpu_check.sh
BENCH_BEFORE=${BENCH_BEFORE:-330}
mkdir -p gpu_check
# The environment, once (the lanes find it made).
ONLY='^(nvidia_smi|env)$' RESULTS=$PWD/gpu_check/setup bash $CHECK tests > gpu_check/setup.txt 2>&1
tail -n 5 gpu_check/setup.txt
ONLY='^gpu_suite_np(1|2|4)$|streams2' RESULTS=$PWD/gpu_check/lane_a bash $CHECK tests \
    > gpu_check/lane_a.txt 2>&1 &
ONLY='staging|2x2|driver|logdir|cnn' RESULTS=$PWD/gpu_check/lane_b bash $CHECK tests \
    > gpu_check/lane_b.txt 2>&1 &
( ONLY='^(c10d|trainer|glue)' RESULTS=$PWD/gpu_check/lane_c bash $CHECK hf
  ONLY='gpu_mpi_tests' RESULTS=$PWD/gpu_check/lane_c2 bash $CHECK tests ) \
    > gpu_check/lane_c.txt 2>&1 &
wait
echo "lanes done after ${SECONDS}s"
for lane in lane_a lane_b lane_c lane_c2; do
    echo "--- $lane"; cat "gpu_check/$lane/summary.txt" 2>/dev/null
done
if [ "$SECONDS" -lt "$BENCH_BEFORE" ]; then
    STEP_TIMEOUT=${STEP_TIMEOUT:-60} RESULTS=$PWD/gpu_check/bench ONLY='^bench' \
        bash $CHECK bench > gpu_check/bench.txt 2>&1
    echo "--- bench"; cat gpu_check/bench/summary.txt
else
    echo "no time left for the benchmarks (${SECONDS}s >= ${BENCH_BEFORE}s)"
fi
