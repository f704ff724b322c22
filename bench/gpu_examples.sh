#!/usr/bin/env bash
# One device call (about 3 minutes): the examples under torchrun, an MPI launch script, and a rank
# killed in the middle of `ep-comm stress` for every built backend, on the GPUs of one machine.
# Every command checks its own results (dense reference, oracle); logs go to $OUT, and one summary
# line per command with its exit code is printed at the end (also in $OUT/examples_summary.txt).
#
# Usage (device machine, repository root): bash bench/gpu_examples.sh
# Variables: OUT (/tmp/ep_out), NPROC (2), SKIP_INSTALL=1 (already installed), SKIP_KILL=1 (no
# killed-rank runs), MPI_EXTRA_ARGS (default for Open MPI as root: --allow-run-as-root --oversubscribe).
set -uo pipefail
OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
# multicast / NVLS stays off on these shared machines
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl
export NVSHMEM_REMOTE_TRANSPORT=none
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the examples import this checkout's ep_comm
export EP_COMM_PYTHON=python3
NPROC=${NPROC:-2}
TAG="ep-comm-gpu-examples-$$-$RANDOM"  # in the environment of every command we start: finds leftovers
SUMMARY="$OUT/examples_summary.txt"; : > "$SUMMARY"
T_START=$SECONDS
summary() { echo "== $*" | tee -a "$SUMMARY" >/dev/null; }

# run NAME TIMEOUT CMD...: log to $OUT/NAME.log, one summary line with the exit code
run() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc
    timeout -k 10 "$limit" env "EP_COMM_GPU_EXAMPLES_RUN=$TAG" "$@" > "$OUT/$name.log" 2>&1; rc=$?
    summary "$name rc=$rc ($((SECONDS - t0)) s): $*"
    return $rc
}

rank_pids() {  # the ranks of the CLI process $1 in start order: its spawned children, or its fork server's
    for k in $(pgrep -P "$1"); do
        if grep -qa forkserver "/proc/$k/cmdline"; then pgrep -P "$k"
        elif grep -qa multiprocessing.spawn "/proc/$k/cmdline"; then echo "$k"; fi
    done | sort -n
}

leftovers() {  # pids of our processes still alive (by the tag in their environment)
    grep -lsaz "^EP_COMM_GPU_EXAMPLES_RUN=$TAG\$" /proc/[0-9]*/environ | cut -d/ -f3 | tr '\n' ' '
}

{ nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())"; } \
    > "$OUT/examples_env.txt" 2>&1
if [ -z "${SKIP_INSTALL:-}" ]; then
    run install 170 python3 -m pip install --no-build-isolation --no-deps -e .
fi
BACKENDS=$(python3 -c "from ep_comm.backends import registered; print(' '.join(registered()))" 2>>"$OUT/examples_env.txt")
summary "built backends: ${BACKENDS:-none (import failed, see examples_env.txt)}"

# 1-2. the examples under torchrun: each rank compares itself with a dense reference and exits non-zero otherwise
if command -v torchrun >/dev/null 2>&1; then TORCHRUN=(torchrun); else TORCHRUN=(python3 -m torch.distributed.run); fi
for ex in moe_layer standard_layout; do
    run "torchrun_$ex" 90 "${TORCHRUN[@]}" --nproc-per-node "$NPROC" "examples/$ex.py"
    grep -E "^rank [0-9]+/" "$OUT/torchrun_$ex.log" | sed 's/^/     /' | tee -a "$SUMMARY" >/dev/null
done

# 3. the MPI launch script that matches the mpirun on this machine: `ep-comm stress` checks every
#    built backend against the oracle.  First the real MPI rendezvous (rank 0's address broadcast
#    with mpi4py); if that fails, once more with MASTER_ADDR/PORT given, to tell mpi4py problems apart.
MPI_VERSION=$( (mpirun --version || mpiexec --version) 2>&1 | head -3)
if echo "$MPI_VERSION" | grep -q HYDRA; then
    MPI_SCRIPT=launch/mpirun_mpich.sh
else
    MPI_SCRIPT=launch/mpirun_openmpi.sh
    [ "$(id -u)" = 0 ] && export MPI_EXTRA_ARGS=${MPI_EXTRA_ARGS:---allow-run-as-root --oversubscribe}
fi
summary "mpi: $(echo "$MPI_VERSION" | head -1) -> $MPI_SCRIPT"
export NP=$NPROC GPUS_PER_NODE=$NPROC
if ! run mpi_stress 120 bash "$MPI_SCRIPT" stress --iters 20 --op-timeout 60; then
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$((29000 + RANDOM % 1000)) \
        run mpi_stress_master_addr 120 bash "$MPI_SCRIPT" stress --iters 20 --op-timeout 60
fi
grep -hE "^stress (PASSED|FAILED)|^(naive|ag_rs|mnnvl|nvshmem) " "$OUT"/mpi_stress*.log 2>/dev/null \
    | sed 's/^/     /' | tee -a "$SUMMARY" >/dev/null
unset NP GPUS_PER_NODE

# 4. kill -9 rank 1 in the middle of `ep-comm stress`, per built backend: expected a non-zero exit,
#    every survivor failing with EPTimeoutError naming rank 1 within --op-timeout + 10 s, no leftovers.
OP_TIMEOUT=10
if [ -z "${SKIP_KILL:-}" ]; then
    for b in $BACKENDS; do
        log="$OUT/kill_rank_$b.log"
        env "EP_COMM_GPU_EXAMPLES_RUN=$TAG" python3 -m ep_comm stress --nproc "$NPROC" --iters 100000 --op-timeout $OP_TIMEOUT --backend "$b" \
            --layout standard > "$log" 2>&1 &
        parent=$!
        for _ in $(seq 300); do grep -q "^ep-comm stress:" "$log" && break; kill -0 $parent 2>/dev/null || break; sleep 0.3; done
        sleep 2  # let it run a few hundred iterations, so the kill lands mid-stress
        victim=$(rank_pids $parent | sed -n 2p)
        if [ -z "$victim" ]; then
            summary "kill_rank $b: stress did not start (see $log)"; kill -9 $parent 2>/dev/null; wait $parent 2>/dev/null; continue
        fi
        t0=$(date +%s.%N); kill -9 "$victim"
        for _ in $(seq $(( (OP_TIMEOUT + 40) * 10 ))); do kill -0 $parent 2>/dev/null || break; sleep 0.1; done
        secs=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
        kill -9 $parent 2>/dev/null; wait $parent; rc=$?  # rc 137 here means it had to be killed
        sleep 1  # the launcher's children are reaped by now; give their exit a moment before looking
        # (progress bars share lines with these, so no anchors; the rank's own error first, the launcher's after)
        survivor=$(grep -aoE "(--- rank 0 failed|ep-comm stress: rank 0): [A-Za-z]+(Error|Exception).{0,200}" "$log" | head -1)
        summary "kill_rank $b rc=$rc (non-zero expected) ${secs} s after kill -9 of rank 1 (bound $((OP_TIMEOUT + 10)) s); leftovers: $(leftovers)"
        summary "     ${survivor:-no failure line from rank 0}"
    done
fi

left=$(leftovers)
[ -n "$left" ] && { summary "killing leftovers: $left"; kill -9 $left 2>/dev/null; }
summary "total $((SECONDS - T_START)) s"
cat "$SUMMARY"
