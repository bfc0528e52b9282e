#!/usr/bin/env bash
# Which srun --mpi= plugin joins mpitrain's processes, seen on a one-node Slurm on this machine.
#
# Starts munged (unless running), slurmctld and slurmd with a private slurm.conf, runs a 2-task
# mpitrain job through srun with each --mpi= plugin (and through mpitrainrun inside salloc),
# prints one line per case, and stops what it started.  The README's "Launchers" table is what
# this printed.  Needs root and Debian's packages:
#   apt-get install -y slurmd slurmctld slurm-client munge libpmix-dev
# Usage: bash scripts/slurm_launchers.sh [VENV]      (default .venv)
# With MPICH_PREFIX=DIR (from `VENV/bin/pip install --prefix DIR --no-deps mpich`) the same
# cases run with mpi4py on the mpich wheel too.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=$VENV/bin/python
for tool in srun salloc sinfo slurmctld slurmd munged; do
    command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y slurmd" \
        "slurmctld slurm-client munge libpmix-dev" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "run as root (slurmd starts the tasks)" >&2; exit 2; }

DIR=$(mktemp -d /tmp/mpitrain-slurm.XXXXXX)
HOST=$(hostname -s)
export SLURM_CONF=$DIR/slurm.conf
cat > "$SLURM_CONF" <<EOF
ClusterName=mpitrain
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6917}
SlurmdPort=${SLURMD_PORT:-6918}
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=$HOST CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
mkdir -p "$DIR/state" "$DIR/spool"

started_munged=""
cleanup() {
    for f in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
        [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
    done
    if [ -n "$started_munged" ] && [ -f /run/munge/munged.pid ]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    fi
    sleep 1
    rm -rf "$DIR"
}
trap cleanup EXIT
if ! [ -S /run/munge/munge.socket.2 ] || ! munge -n >/dev/null 2>&1; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    su -s /bin/sh munge -c /usr/sbin/munged
    started_munged=1
fi
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 30); do
    sinfo -h -o %t 2>/dev/null | grep -q idle && break
    sleep 1
done

export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
CODE='import mpitrain as hvd; hvd.init(); print(f"rank {hvd.rank()} of {hvd.size()}")'
verdict() {  # stdout file, stderr file -> one word and the line that shows it
    if [ "$(grep -c ' of 2$' "$1")" = 2 ]; then echo "works (2 ranks of 2)"
    elif grep -q "^mpitrain: .* started 2 processes (" "$2"; then
        echo "refused by mpitrain: $(grep -m1 '^mpitrain: .* started 2 processes (' "$2" | cut -c1-90)..."
    else echo "failed: $(grep -v '^\s*$' "$2" | grep -iv 'srun: error' | tail -1 | cut -c1-100)"
    fi
}
run_case() {  # label, then the command
    local label=$1; shift
    timeout 180 "$@" >"$DIR/out" 2>"$DIR/err" || true
    printf '%-42s %s\n' "$label" "$(verdict "$DIR/out" "$DIR/err")"
}
libraries=(openmpi)
[ -n "${MPICH_PREFIX:-}" ] && libraries+=(mpich)
echo "# $(srun --version), $(nproc) cores, $(date +%F)"
for lib in "${libraries[@]}"; do
    envs=()
    if [ "$lib" = mpich ]; then
        envs=(env "MPI4PY_LIBMPI=$MPICH_PREFIX/lib/libmpi.so.12" "LD_LIBRARY_PATH=$MPICH_PREFIX/lib")
    fi
    for plugin in pmix pmi2 none; do
        run_case "$lib: srun --mpi=$plugin -n 2" "${envs[@]}" srun --mpi="$plugin" -n 2 "$PY" -c "$CODE"
    done
    flavor=openmpi; [ "$lib" = mpich ] && flavor=mpich
    run_case "$lib: salloc -n 2 mpitrainrun -np 2" "${envs[@]}" salloc -n 2 "$PY" -m \
        mpitrain.runner.launch --mpi "$flavor" -np 2 "$PY" -c "$CODE"
done
