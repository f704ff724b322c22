// The input verdict in front of an eager dispatch with id validation (Phase.CHECKED): every rank's ids
// range-checked and the verdicts exchanged on the GPU, so every rank skips a call with bad input alike.
#include "one_sided/kernel_common.cuh"

namespace ep_comm {
namespace EP_KERNELS {
namespace {

// Wait for a peer's verdict for the call ``code``; every few hundred polls also look at its call flag,
// where a peer on another call shows up (mismatch, recorded as wait_flag records it).  0 after giving up.
__device__ __forceinline__ uint64_t wait_verdict(const Common& c, int parity, int peer, uint32_t code,
                                                 uint64_t deadline, const ErrorSink& err) {
  const uint64_t* slot = flag_slot(c, c.lay.rank, kVerdictRows + parity, peer);
  const uint64_t* main = flag_slot(c, c.lay.rank, parity, peer);
  uint32_t spins = 0;
  while (true) {
    const uint64_t v = ld_acquire_sys(slot);
    if (static_cast<uint32_t>(v) == code) return v;
    if ((++spins & 255u) != 0) continue;
    if (on_other_call(static_cast<uint32_t>(ld_acquire_sys(main)), code, peer, err)) return 0;
    if (global_timer_ns() > deadline) {
      err.peer(peer, kReasonTimeout, static_cast<uint32_t>(v), code);
      err.count(kStatusTimeouts, 1);
      return 0;
    }
  }
}

// The input verdict of an eager dispatch with id validation (Phase.CHECKED): this rank's ids are
// range-checked, its verdict (bit 0: input the host refused, bit 1: ids out of range) goes to every
// rank's verdict slot, and once every rank's verdict is in, State.VERDICT says whether the dispatch
// launched behind this kernel runs or is skipped on every rank.  The host waits for this kernel alone,
// never for the dispatch.  ``advance``: no dispatch follows (this rank's input was refused), so this
// kernel takes the call number.  One block: the ids of one call are at most max_tokens * top_k.
template <bool kIds64>
__global__ void __launch_bounds__(kThreads, 1) verdict_kernel(const Common c, const void* ids, int64_t n,
                                                              int own_bad, bool advance) {
  const uint64_t deadline = global_timer_ns() + c.lay.timeout_ns;
  const ErrorSink err{c.status, c.lay.pending, c.lay.world};
  const auto [seq, code, parity] = current_call(c, kOpDispatch, kPhaseBoth);
  bool bad_ids = false;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const long long v = kIds64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
    bad_ids |= v < -1 || v >= c.lay.num_experts;
  }
  const int verdict = own_bad | (__syncthreads_or(bad_ids) ? 2 : 0);
  if (threadIdx.x == 0 && (verdict & 2)) err.raise_pending(kPendingIdsCheck);
  const uint64_t value = (static_cast<uint64_t>(verdict) << 32) | code;
  signal_all(c, kVerdictRows + parity, value);
  // the same code, marked, in the call flags: a peer on another call (a combine of this number, say)
  // sees at once that this rank is in a dispatch (the dispatch's own wait skips marked flags)
  signal_all(c, parity, kVerdictMark | value);
  bool skip = false;
  for (int peer = threadIdx.x; peer < c.lay.world; peer += blockDim.x) {
    if (!peer_active(c.lay, peer)) continue;
    const uint64_t v = wait_verdict(c, parity, peer, code, deadline, err);
    skip |= v == 0 || (v >> 32) != 0;  // a verdict that never came skips the call too (the error says why)
  }
  if (__syncthreads_or(skip) && threadIdx.x == 0) {
    *reinterpret_cast<volatile unsigned long long*>(c.counters + kStateVerdict) = 1ull;
    err.raise_pending(kPendingVerdict);
  } else if (threadIdx.x == 0) {
    *reinterpret_cast<volatile unsigned long long*>(c.counters + kStateVerdict) = 0ull;
  }
  if (advance && threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(c.counters + kStateSeq) = seq + 1;
}

}  // namespace

cudaError_t launch_verdict(const Common& c, const void* ids, bool ids_int64, int64_t n, int own_bad, bool advance,
                           cudaStream_t stream) {
  if (ids_int64) verdict_kernel<true><<<1, kThreads, 0, stream>>>(c, ids, n, own_bad, advance);
  else verdict_kernel<false><<<1, kThreads, 0, stream>>>(c, ids, n, own_bad, advance);
  return cudaGetLastError();
}

}  // namespace EP_KERNELS
}  // namespace ep_comm
