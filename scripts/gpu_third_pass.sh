#!/usr/bin/env bash
# Issue 42's device checks in one call of at most 10 minutes, in order of what the issue needs
# first, each step a scripts/gpu_check.sh step under its own time limit:
#
#   WHEELS=.whl bash scripts/gpu_third_pass.sh      # on the lent machine; results in ./gpu_check/
#                                                   # and, with $OUT set, packed into $OUT
#   DEADLINE=500 ...                                # start no step after this many seconds
#                                                   # (default 480: one call of at most 600 s;
#                                                   # a step cut off by the call's end loses
#                                                   # only itself: each is packed when done)
#   bash scripts/gpu_third_pass.sh --dry-run        # print the plan, run nothing
#
# 1. timed, alone on the GPU: host time per device allreduce at 2 ranks (numba's dispatch and
#    the prepared launches, benchmarks/gpu_host_overhead.py), the kernel table against the
#    device copy bandwidth, BERT-base at one rank with mpitrain and with torch DDP over NCCL,
#    and the allreduce at 2 ranks (algbw/busbw, 1 MiB .. 256 MiB);
# 2. tests, in two lanes sharing the GPU: the GPU suite at 1, 2 and 4 ranks; the DDP drop-in's
#    MPI suite at 2 and 4 ranks with its whole report, and the 4-rank CNN check;
# 3. timed again, while the deadline allows: the allreduce at 4 ranks, with 1, 2 and 4 streams,
#    and the host time at one rank.
#
# Every step's log, JSON and summary land in gpu_check/<phase>/ (see scripts/gpu_check.sh);
# gpu_check.sh packs each folder into $OUT/<phase>.tgz after every step, so a call cut short
# still brings back what ran.  This script's own log is gpu_check/third_pass.txt (also packed).
set -uo pipefail
cd "$(dirname "$0")/.."
CHECK=scripts/gpu_check.sh
DEADLINE=${DEADLINE:-480}
DRY=0
[ "${1:-}" = --dry-run ] && DRY=1
mkdir -p gpu_check
LOG=gpu_check/third_pass.txt
: > "$LOG"
say() { echo "$*" | tee -a "$LOG"; }
pack_log() { if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; cp "$LOG" "$OUT/third_pass.txt"; fi; }
# run NAME PART REGEX: the steps of gpu_check.sh PART whose names match REGEX, results in
# gpu_check/NAME; skipped once the deadline has passed (a phase started before it is bounded by
# its steps' own limits).
run() {
    local name=$1 part=$2 regex=$3
    if [ "$SECONDS" -ge "$DEADLINE" ]; then
        say "skip   $name ($part: $regex): ${SECONDS}s >= deadline ${DEADLINE}s"
        return 0
    fi
    say "start  $name at ${SECONDS}s: gpu_check.sh $part, steps matching $regex"
    if [ "$DRY" = 1 ]; then return 0; fi
    ONLY=$regex RESULTS=$PWD/gpu_check/$name bash "$CHECK" "$part" > "gpu_check/$name.txt" 2>&1
    say "done   $name at ${SECONDS}s (exit $?)"
    [ -f "gpu_check/$name/summary.txt" ] && sed 's/^/         /' "gpu_check/$name/summary.txt" \
        | tee -a "$LOG"
    pack_log
}

# The environment once (every later call finds it made), with the machine's report.
run setup tests '^(nvidia_smi|env)$'
# 1. What the issue's numbers need, timed with nothing else on the GPU.
STEP_TIMEOUT=90 run timed_host bench '^host_overhead_np2$'
STEP_TIMEOUT=60 run timed_kernels bench '^bench_kernels$'
STEP_TIMEOUT=90 run timed_bert train '^bert_np1_(mpitrain|nccl)$'
STEP_TIMEOUT=90 run timed_allreduce2 bench '^bench_allreduce_np2$'
# 2. Tests in two lanes at once (nothing timed runs beside them).
if [ "$SECONDS" -lt "$DEADLINE" ]; then
    run lane_suite tests '^gpu_suite_np(1|2|4)$' &
    run lane_ddp tests '^(ddp_dropin_np(2|4)|cnn_np4)$' &
    wait
fi
# 3. The rest of the measurements, while there is time.
STEP_TIMEOUT=90 run timed_allreduce4 bench '^bench_allreduce_np4$'
for streams in 1 2 4; do
    STEP_TIMEOUT=60 run "timed_streams$streams" bench "^bench_streams$streams\$"
done
STEP_TIMEOUT=60 run timed_host1 bench '^host_overhead_np1$'
say "finished at ${SECONDS}s"
for summary in gpu_check/*/summary.txt; do
    [ -f "$summary" ] && { say "--- $(basename "$(dirname "$summary")")"; cat "$summary" \
        | tee -a "$LOG"; }
done
pack_log
