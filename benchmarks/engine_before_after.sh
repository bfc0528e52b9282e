#!/usr/bin/env bash
# Engine overhead before and after a change, interleaved round by round so that drift on a
# shared machine hits both alike: BEFORE is a commit (checked out into a temporary worktree),
# the working tree is after.  Prints the raw tables; compare medians over the rounds.
#
#   bash benchmarks/engine_before_after.sh d913ad9 10
set -euo pipefail
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
BEFORE=${1:?usage: engine_before_after.sh COMMIT [ROUNDS]}
ROUNDS=${2:-10}
TREE=$(mktemp -d)
trap 'git worktree remove --force "$TREE" >/dev/null 2>&1 || true' EXIT
git worktree add -q --detach "$TREE" "$BEFORE"
MPIRUN=(.venv/bin/mpirun -np 2 --oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
for round in $(seq 1 "$ROUNDS"); do
    for side in before after; do
        src=$PWD/src
        [ "$side" = before ] && src=$TREE/src
        echo "=== round $round $side $(cat /proc/loadavg)"
        "${MPIRUN[@]}" -x PYTHONPATH="$src" -x MPITRAIN_CALIBRATION_CACHE= \
            .venv/bin/python benchmarks/engine_overhead.py --ops 1000 --repeats 5
    done
done
