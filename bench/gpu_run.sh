#!/usr/bin/env bash
# One device call: install, all GPU tests, benchmark; logs under $OUT, short summary last.
# Usage (device machine, repo root): bash bench/gpu_run.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl
export NVSHMEM_REMOTE_TRANSPORT=none
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
summary() { echo "== $*" | tee -a "$OUT/summary.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } > "$OUT/env.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())" >> "$OUT/env.txt" 2>&1
summary "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"

pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1; summary "install rc=$?"

[ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider ${TEST_PATHS:-tests/} > "$OUT/gpu_tests.log" 2>&1
summary "gpu tests rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20 | tee -a "$OUT/summary.txt"

if [ "${1:-}" != "quick" ]; then
  export EP_COMM_HANG_DUMP_S=${EP_COMM_HANG_DUMP_S:-150}
  for run in ${BENCH_RUNS:-eager:128,4096 graph:128 graph:4096}; do
    mode=${run%%:*}; toks=${run#*:}; tag="$mode-${toks//,/-}"
    timeout ${BENCH_TIMEOUT:-200} python3 -m ep_comm bench --nproc $NPROC --mode $mode --tokens ${toks//,/ } --phase-times ${BENCH_ARGS:-} --json "$OUT/bench-$tag.json" > "$OUT/bench-$tag.log" 2>&1
    summary "bench $mode tokens $toks rc=$?"
    grep -E "^(backend|naive|ag_rs|mnnvl|nvshmem|auto|deepep|peer |phase times)" "$OUT/bench-$tag.log" | tee -a "$OUT/summary.txt"
  done
  [ -n "${SKIP_INFO:-}" ] || timeout 60 python3 -m ep_comm info --nproc $NPROC > "$OUT/info.log" 2>&1; summary "info rc=$?"
  [ -n "${SKIP_STRESS:-}" ] || timeout 100 python3 -m ep_comm stress --nproc $NPROC --iters ${STRESS_ITERS:-50} > "$OUT/stress.log" 2>&1
  summary "stress rc=$?: $(tail -4 "$OUT/stress.log" | tr '\n' ' ')"
fi
cat "$OUT/summary.txt"
