// The one-sided kernels: dispatch/combine by stores into the peers' buffers (or NVSHMEM puts).
//
// They are compiled once per memory provider.  The plain build (ep_comm._C, backend mnnvl) reaches
// peers through buffers mapped by ep_comm.memory (cuMem VMM); the NVSHMEM build (EP_COMM_NVSHMEM:
// ep_comm._C_nvshmem, backend nvshmem, compiled with -rdc) reaches them through nvshmem_ptr or puts.
//
// Every rank's symmetric buffer holds, per parity p = seq & 1 (seq = this communicator's call
// number, advanced on the device so CUDA-graph replays advance it too):
//   flags    [2][world] u64      flag of (parity, source rank): code(seq, op) | T << 32
//   group flags [2][world][max_groups] u64: grouped combine, flag of (parity, source, group of
//                                 kGroupTokens tokens): code(seq, combine) once source's partials of the group landed
//   dispatch [world][max_tokens] rows of row_stride bytes: RowHeader | local ids[k] | weights[k] |
//                                 slot indices[k] | payload | scales; source s writes token t at [s][t]
//   counts   [world][num_local] int32: how many rows source s sent for each local expert (the
//                                 receiver's prefix over sources turns slot indices into batched slots)
//   combine  [world][max_tokens] rows of combine_stride bytes: the partial output of token t that
//                                 rank s computed, written by s at [s][t] of the token's owner
// A rank may start call seq+2 only after every peer signalled call seq+1, which a peer does only
// after finishing call seq; so two parities make the buffers reusable without a barrier.
//
// Put mode (the nvshmem backend's network path; NVSHMEM build only): peers are not mapped.
// What would be stored into a peer's buffer is written to a staging copy in this rank's own buffer
// (stage rows [world][max_tokens], staged partials [world][max_tokens], staged counts [world][L]) and
// moved with NVSHMEM puts to the same offset of the peer's buffer; every thread quiets its puts before
// the grid arrival, and flags travel as NVSHMEM signals.  PE numbers are the ranks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/protocol.h"

// Each build gets its own namespace: two extensions define these kernels.
#ifdef EP_COMM_NVSHMEM
#define EP_KERNELS one_sided_nvshmem
#else
#define EP_KERNELS one_sided
#endif

namespace ep_comm {
namespace EP_KERNELS {

constexpr int kWarps = kThreads / 32;

struct Layout {
  int rank, world, max_tokens, num_experts, num_local, top_k, hidden, batched;
  int64_t row_stride, payload_offset, scale_offset, payload_max, scale_max;
  int64_t flags_offset, dispatch_offset[2], combine_offset[2], counts_offset[2], combine_stride;
  int64_t group_flags_offset;
  int max_groups;
  int put;  // put mode (above); always 0 outside the NVSHMEM build
  int zero_copy;  // standard layout: rows stay in dispatch half 0 of the buffer (protocol.h, kCfgZeroCopy)
  int64_t stage_offset, stage_combine_offset, stage_counts_offset;
  uint64_t timeout_ns;
  int32_t* pending;  // host-mapped
  const int32_t* active;  // [world] 1 for the ranks still in after a shrink, or null: every rank (kCfgActivePtr)
  uint64_t* trace;   // phase stamps or null (protocol.h, kCfgTracePtr)
};

Layout layout_from_cfg(const int64_t* cfg);

struct Common {
  Layout lay;
  const int64_t* peer_base;      // [world] base of each rank's buffer in this process (device memory)
  unsigned long long* counters;  // state head (kStateSeq, kStateArrive)
  int32_t* status;               // error record (device memory)
};

struct DispatchParams {
  Common c;
  const int32_t* expert_owner;  // [num_experts]: owner rank << 16 | local index
  const void* x;                // T rows of payload_bytes (or hidden of the quant input dtype), x_row_bytes apart
  int64_t x_row_bytes;          // row pitch: x may be a row-strided view (the input in place)
  const void* ids;              // [T, k] int32 or int64
  const float* weights;         // [T, k]
  const void* x_scales;         // [T, scale_row_bytes] or null
  const float* global_scale;    // NVFP4: the float32 global scale on the device (one value), else null
  int num_tokens;
  int chunks;                   // pieces each token's row is split into on the send side, of
  int64_t chunk_bytes;          // bytes each (a multiple of 16; of 256 channels with fp8 and NVFP4)
  int64_t payload_bytes;        // bytes per row on the wire
  int64_t scale_bytes;
  int64_t capacity;             // rows per expert (batched)
  int32_t* send_count;          // [world][L] workspace: rows sent per (destination, local expert), zero between calls
  int32_t* self_slot;           // [max_tokens][k] workspace: own tokens' batched slots, for the chunk warps
  uint32_t* self_ready;         // [max_tokens] workspace: code of the call whose self_slot row is written
  void* out_x;                  // standard [N, payload]; batched [L, capacity, payload]
  void* out_scales;             // same leading dims, scale_bytes per row, or null
  int32_t* row_ids;             // [N, k] local expert ids (-1: none / padding)
  float* row_w;                 // [N, k]
  int32_t* row_slot;            // [N, k] batched: flat row in [L * capacity] of each id, else null
  int32_t* counts;              // [L] batched expert_num_tokens, else null
  int32_t* dest;                // [T, k] destination ranks of each own token (-1 padded)
  int phases;                   // kPhaseSend | kPhaseReceive (protocol.h)
  bool checked;                 // kPhaseChecked: an input verdict precedes the launch (protocol.h)
  int receive_warps;            // > 0: that many warps of each block receive while the others send (Cfg.RECEIVE_WARPS)
  bool prefetch_pieces;         // pieces of at most kPrefetchPieceBytes: header, meta and payload loaded at once
};

// A received piece this small is loaded whole into registers (4 vectors a lane) with its header and
// meta, one latency instead of three dependent ones (decode sizes).
constexpr int kPrefetchVecs = 4;
constexpr int64_t kPrefetchScaleBytes = 32 * 16;  // one 16-byte vector a lane
constexpr int64_t kPrefetchPieceBytes = kPrefetchVecs * kPrefetchScaleBytes;

struct CombineParams {
  Common c;
  const void* expert_out;  // standard [N, hidden]; batched [L, capacity, hidden]
  const int32_t* row_ids;
  const float* row_w;
  const int32_t* row_slot;
  const int32_t* dest;
  int num_tokens;
  int chunks;          // pieces each row is split into (latency of small batches)
  int chunk_elems;     // elements per piece (a multiple of 256 unless chunks == 1)
  int grouped;         // signal and sum per group of kGroupTokens tokens (prefill sizes, both phases):
                       // 0 off, 1 interleaved in every block, n >= 2 split: n - 1 sending blocks
  int sum_warps;       // > 0 (grouped 1, both phases): that many warps of each block only sum, the others send
  int phases;          // kPhaseSend | kPhaseReceive (protocol.h)
  int pull;            // expert_out is combine half 0 and peers read it in place (kCfgCombinePullInput)
  void* out;  // [T, hidden] of the transport dtype
};

// quant_dtype: < 0 no quantisation; the input's dtype code kBf16 / kFp16 / kFp32 (protocol.h) for fp8;
// kDispatchNvfp4 + that code for NVFP4.
constexpr int kDispatchNvfp4 = 8;
cudaError_t launch_dispatch(const DispatchParams& p, int quant_dtype, bool ids_int64, int num_blocks,
                            cudaStream_t stream);
cudaError_t launch_combine(const CombineParams& p, int in_dtype, int out_dtype, int num_blocks,
                           cudaStream_t stream);
// Tell every peer this rank gives up the current call (its input was invalid), without data.
cudaError_t launch_abort(const Common& c, int calls, cudaStream_t stream);
// The input verdict in front of an eager checked dispatch (dispatch.cu, verdict_kernel).
cudaError_t launch_verdict(const Common& c, const void* ids, bool ids_int64, int64_t n, int own_bad, bool advance,
                           cudaStream_t stream);

}  // namespace EP_KERNELS
}  // namespace ep_comm
