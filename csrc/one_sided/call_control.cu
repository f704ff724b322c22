// What every one-sided call shares outside the data kernels: the layout read from the config table
// (protocol.h), and the abort kernel that gives up call numbers so that peers are not left waiting.
#include "one_sided/kernel_common.cuh"

namespace ep_comm {
namespace EP_KERNELS {

Layout layout_from_cfg(const int64_t* cfg) {
  Layout l;
  l.rank = static_cast<int>(cfg[kCfgRank]);
  l.world = static_cast<int>(cfg[kCfgWorld]);
  l.max_tokens = static_cast<int>(cfg[kCfgMaxTokens]);
  l.num_experts = static_cast<int>(cfg[kCfgNumExperts]);
  l.num_local = static_cast<int>(cfg[kCfgNumLocal]);
  l.top_k = static_cast<int>(cfg[kCfgTopK]);
  l.hidden = static_cast<int>(cfg[kCfgHidden]);
  l.batched = static_cast<int>(cfg[kCfgBatched]);
  l.row_stride = cfg[kCfgRowStride];
  l.payload_offset = cfg[kCfgPayloadOffset];
  l.scale_offset = cfg[kCfgScaleOffset];
  l.payload_max = cfg[kCfgPayloadMax];
  l.scale_max = cfg[kCfgScaleMax];
  l.flags_offset = cfg[kCfgFlagsOffset];
  l.dispatch_offset[0] = cfg[kCfgDispatchOffset0];
  l.dispatch_offset[1] = cfg[kCfgDispatchOffset1];
  l.combine_offset[0] = cfg[kCfgCombineOffset0];
  l.combine_offset[1] = cfg[kCfgCombineOffset1];
  l.counts_offset[0] = cfg[kCfgCountsOffset0];
  l.counts_offset[1] = cfg[kCfgCountsOffset1];
  l.combine_stride = cfg[kCfgCombineStride];
  l.timeout_ns = static_cast<uint64_t>(cfg[kCfgTimeoutNs]);
  l.pending = reinterpret_cast<int32_t*>(static_cast<uintptr_t>(cfg[kCfgPendingPtr]));
  l.trace = reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(cfg[kCfgTracePtr]));
  l.group_flags_offset = cfg[kCfgGroupFlagsOffset];
  l.max_groups = max_groups(l.max_tokens);
  l.put = static_cast<int>(cfg[kCfgPutMode]);
  l.stage_offset = cfg[kCfgStageOffset];
  l.stage_combine_offset = cfg[kCfgStageCombineOffset];
  l.stage_counts_offset = cfg[kCfgStageCountsOffset];
  l.zero_copy = static_cast<int>(cfg[kCfgZeroCopy]);
  l.active = reinterpret_cast<const int32_t*>(static_cast<uintptr_t>(cfg[kCfgActivePtr]));
  return l;
}

namespace {

// Tell every peer that this rank gives up ``calls`` call numbers from the current one: 1, a combine;
// 2, a dispatch and the combine that would have followed it (the peers' hosts are on their way to it).
// The second number's flag slot is also the one of this rank's previous combine, which a slow peer may
// still be reading: it is written only once every peer has signalled the current call.
__global__ void abort_kernel(const Common c, int calls) {
  const auto [seq, code, parity] = current_call(c, kOpAbort, kPhaseBoth);
  signal_all(c, parity, code);
  if (calls > 1) {
    const uint64_t deadline = global_timer_ns() + c.lay.timeout_ns;
    const ErrorSink err{c.status, c.lay.pending, c.lay.world};
    for (int peer = threadIdx.x; peer < c.lay.world; peer += blockDim.x) {
      if (peer == c.lay.rank || !peer_active(c.lay, peer)) continue;
      const uint64_t* flag = flag_slot(c, c.lay.rank, parity, peer);
      uint32_t spins = 0;
      while (true) {
        const uint32_t seen = static_cast<uint32_t>(ld_acquire_sys(flag));
        if (seen != 0 && code_seq(seen) == code_seq(code)) break;  // any op: the peer reached this call
        if (seen != 0 && code_ahead(seen, code)) {
          err.peer(peer, kReasonMismatch, seen, code);
          break;
        }
        if ((++spins & 255u) == 0 && global_timer_ns() > deadline) {
          err.peer(peer, kReasonTimeout, seen, code);
          err.count(kStatusTimeouts, 1);
          break;
        }
      }
    }
    __syncthreads();
    signal_all(c, parity ^ 1, make_code(seq + 1, kOpAbort));
  }
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(c.counters + kStateSeq) = seq + calls;
}

}  // namespace

cudaError_t launch_abort(const Common& c, int calls, cudaStream_t stream) {
  abort_kernel<<<1, 128, 0, stream>>>(c, calls);
  return cudaGetLastError();
}

}  // namespace EP_KERNELS
}  // namespace ep_comm
