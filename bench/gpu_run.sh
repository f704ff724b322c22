#!/usr/bin/env bash
# One device call: install (reusing a carried build of csrc/ when the sources are unchanged), GPU tests,
# benchmark, stress; logs under $OUT, a short summary last.
# Usage (device machine, repo root): bash bench/gpu_run.sh [quick]
#   NPROC=4           ranks (default: every GPU)
#   TEST_PATHS=...    pytest paths (default tests/); SKIP_TESTS=1 skips them
#   BENCH_RUNS="graph:128 eager:128,4096 eager-idle:128"  mode:tokens list (eager-idle: --eager-launch idle;
#                     eager-off: --validate-ids off);
#                     BENCH_ARGS extra bench flags
#   STRESS_ITERS=1000 STRESS_BACKEND=mnnvl; SKIP_STRESS=1 / SKIP_INFO=1
#   TRACE_ARGS="--tokens 128 4096"  run bench/kernel_trace.py (mnnvl phase stamps) with these flags
set -uo pipefail
OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16 CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl
export NVSHMEM_REMOTE_TRANSPORT=none
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | wc -l)}
summary() { echo "== $*" | tee -a "$OUT/summary.txt"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } > "$OUT/env.txt" 2>&1
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())" >> "$OUT/env.txt" 2>&1
summary "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"

# the extensions (_C, and _C_nvshmem where the NVSHMEM wheel is): reuse .ext/<name>-<hash of the sources>.so.gz
# when carried, else build and hand them back gzipped in $OUT (a raw _C is over the 16 MiB a file may have)
hash=$(cat setup.py $(find csrc -type f \( -name "*.cu" -o -name "*.cuh" -o -name "*.h" -o -name "*.cpp" \) | sort) | sha1sum | cut -c1-16)
suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
t0=$(date +%s)
if [ -f ".ext/_C-$hash.so.gz" ]; then
  for f in .ext/*-$hash.so.gz; do n=$(basename "$f" "-$hash.so.gz"); gunzip -c "$f" > "ep_comm/$n$suffix"; done
  EP_COMM_BUILD_CUDA=0 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
  summary "install rc=$? (carried build $hash: $(ls .ext/*-$hash.so.gz | xargs -n1 basename | tr '\n' ' ')) in $(( $(date +%s) - t0 )) s"
else
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
  rc=$?; summary "install rc=$rc (built $hash) in $(( $(date +%s) - t0 )) s"
  if [ $rc -eq 0 ]; then
    for f in ep_comm/_C*$suffix; do n=$(basename "$f" "$suffix"); gzip -c "$f" > "$OUT/$n-$hash.so.gz"; done
  else
    grep -E "error|Error" "$OUT/install.log" | head -20 | tee -a "$OUT/summary.txt"
    exit 1  # nothing below can run without the extensions; don't spend device time on it
  fi
fi
python3 -c "from ep_comm.backends import kernel_ops as k; from ep_comm.memory import nvshmem_heap as n; print('kernels:', k.unavailable_reason() or 'ok', '| nvshmem:', n.unavailable_reason() or n.runtime_summary())" 2>&1 | tee -a "$OUT/summary.txt"

if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider ${TEST_PATHS:-tests/} > "$OUT/gpu_tests.log" 2>&1
  summary "gpu tests rc=$?: $(tail -1 "$OUT/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -30 | tee -a "$OUT/summary.txt"
fi

if [ -n "${TRACE_ARGS:-}" ]; then
  timeout ${TRACE_TIMEOUT:-200} python3 bench/kernel_trace.py --nproc $NPROC $TRACE_ARGS > "$OUT/trace.log" 2>&1
  summary "kernel trace rc=$?"
  grep -vE "^\s*$" "$OUT/trace.log" | tail -${TRACE_LINES:-60} | tee -a "$OUT/summary.txt"
fi

if [ "${1:-}" != "quick" ]; then
  for run in ${BENCH_RUNS:-graph:128 graph:4096 eager:128,4096}; do
    mode=${run%%:*}; toks=${run#*:}; tag="$mode-${toks//,/-}"
    case $mode in
      eager-idle) flags="--mode eager --eager-launch idle" ;;
      eager-off) flags="--mode eager --validate-ids off" ;;
      *) flags="--mode $mode" ;;
    esac
    timeout ${BENCH_TIMEOUT:-200} python3 -m ep_comm bench --nproc $NPROC $flags --tokens ${toks//,/ } \
      --phase-times ${BENCH_ARGS:-} --json "$OUT/bench-$tag.json" > "$OUT/bench-$tag.log" 2>&1
    summary "bench $mode tokens $toks rc=$?"
    grep -E "^(backend|naive|ag_rs|mnnvl|nvshmem|auto|deepep|peer |phase times)" "$OUT/bench-$tag.log" | tee -a "$OUT/summary.txt"
  done
  [ -n "${SKIP_INFO:-}" ] || { timeout 60 python3 -m ep_comm info --nproc $NPROC > "$OUT/info.log" 2>&1; summary "info rc=$?"; }
  if [ -z "${SKIP_STRESS:-}" ]; then
    timeout ${STRESS_TIMEOUT:-150} python3 -m ep_comm stress --nproc $NPROC --iters ${STRESS_ITERS:-200} \
      ${STRESS_BACKEND:+--backend $STRESS_BACKEND} > "$OUT/stress.log" 2>&1
    summary "stress rc=$?: $(tail -4 "$OUT/stress.log" | tr '\n' ' ')"
  fi
fi
cat "$OUT/summary.txt"
