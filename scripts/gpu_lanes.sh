#!/usr/bin/env bash
# scripts/gpu_check.sh's test parts in three lanes at once, then the benchmarks alone while time
# is left: what fits a 15-minute GPU lease (one call of at most 10 minutes).
#
#   WHEELS=.whl bash scripts/gpu_lanes.sh          # on the lent machine; results in ./gpu_check/
#   LANE_B='tests:2x2|driver' ...                  # a lane: PARTS:STEPS[;PARTS:STEPS...], the
#                                                  # gpu_check.sh parts and a regex of its steps
#   BENCH_BEFORE=330 ...                           # start the benchmarks only this many
#                                                  # seconds into the run (default 330)
#
# The lanes share one GPU (tests only: nothing timed runs beside them). The benchmarks run after
# the lanes, alone, each step cut at STEP_TIMEOUT (default 60 s).
set -uo pipefail
cd "$(dirname "$0")/.."
CHECK=scripts/gpu_check.sh
BENCH_BEFORE=${BENCH_BEFORE:-330}
LANE_A=${LANE_A:-'tests:^gpu_suite_np(1|2|4)$|streams2'}
LANE_B=${LANE_B:-'tests:staging|2x2|driver|logdir|cnn'}
LANE_C=${LANE_C:-'hf:.;tests:mpi_'}
mkdir -p gpu_check
lane() {  # NAME SPEC: each PARTS:STEPS of SPEC in turn, results in gpu_check/NAME_<i>
    local name=$1 spec=$2 i=0 segment
    IFS=';' read -ra segments <<< "$spec"
    for segment in "${segments[@]}"; do
        i=$((i + 1))
        ONLY=${segment#*:} RESULTS=$PWD/gpu_check/${name}_$i bash $CHECK ${segment%%:*}
    done > "gpu_check/$name.txt" 2>&1
}
# The environment, once (the lanes find it made).
ONLY='^(nvidia_smi|env)$' RESULTS=$PWD/gpu_check/setup bash $CHECK tests > gpu_check/setup.txt 2>&1
tail -n 5 gpu_check/setup.txt
lane lane_a "$LANE_A" &
lane lane_b "$LANE_B" &
lane lane_c "$LANE_C" &
wait
echo "lanes done after ${SECONDS}s"
for summary in gpu_check/lane_*/summary.txt; do
    echo "--- $(basename "$(dirname "$summary")")"; cat "$summary"
done
if [ "$SECONDS" -lt "$BENCH_BEFORE" ]; then
    STEP_TIMEOUT=${STEP_TIMEOUT:-60} RESULTS=$PWD/gpu_check/bench ONLY='^bench' \
        bash $CHECK bench > gpu_check/bench.txt 2>&1
    echo "--- bench"; cat gpu_check/bench/summary.txt
else
    echo "no time left for the benchmarks (${SECONDS}s >= ${BENCH_BEFORE}s)"
fi
