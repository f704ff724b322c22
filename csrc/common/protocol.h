// The contract between kernel backends and the Python layer: flag codes, the error record's
// layout and the static configuration vector.  ep_comm/backends/kernel_protocol.py mirrors it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD inline
#endif

namespace ep_comm {

// A flag word is 64 bits: low 32 = code(seq, op), high 32 = the sender's token count.
// seq counts this communicator's kernel calls; every rank advances it identically, so a peer whose
// code carries the same seq but another op, or a later seq, is on another call.
enum : uint32_t { kOpDispatch = 1, kOpCombine = 2, kOpAbort = 3 };
constexpr uint32_t kSeqMask = 0x3FFFFFFFu;

EP_HD uint32_t make_code(uint64_t seq, uint32_t op) {
  return (static_cast<uint32_t>(seq & kSeqMask) << 2) | op;
}
EP_HD uint32_t code_seq(uint32_t code) { return code >> 2; }
EP_HD uint32_t code_op(uint32_t code) { return code & 3u; }
// ``code`` belongs to a call after ``expected`` (modulo the 30-bit wrap).
EP_HD bool code_ahead(uint32_t code, uint32_t expected) {
  const uint32_t d = (code_seq(code) - code_seq(expected)) & kSeqMask;
  return d != 0 && d < (kSeqMask >> 1);
}

// int64 counters at the head of the state tensor
// kStateCallInvalid: out-of-range ids seen by the current dispatch launch (kPhaseAbandonOnInvalid)
enum : int { kStateSeq = 0, kStateArrive = 1, kStateZeroed = 2, kStateCallInvalid = 3, kStateCounters = 4 };

// int32 error record after the counters (device memory), layout:
enum : int {
  kStatusInvalidIds = 0,    // out-of-range expert ids treated as -1 (validation switched off)
  kStatusTimeouts = 1,      // waits that gave up
  kStatusOverflow = 2,      // a peer announced more tokens than max_tokens_per_rank
  kStatusLocalStall = 3,    // this rank's own blocks did not all run (grid not resident)
  kStatusRowFormat = 4,     // a peer's rows had another payload/scale width than ours
  kStatusExpectedCode = 5,  // code this rank waited for when the first peer problem was seen
  kStatusRankReason = 8,    // [world] reason bits per peer, then [world] code seen from that peer
};
enum : int { kReasonTimeout = 1, kReasonMismatch = 2, kReasonAbort = 4, kReasonFormat = 8 };

// host-mapped int32 words per communicator (kCfgPendingPtr points at the first)
enum : int { kPendingFatal = 0, kPendingIdsCheck = 1, kPendingRecoverable = 2, kPendingWords = 4 };

EP_HD int status_words(int world) { return kStatusRankReason + 2 * world; }

// Static configuration, one int64 vector per communicator (ep_comm.backends.kernel_protocol).
enum : int {
  kCfgRank = 0,
  kCfgWorld,
  kCfgMaxTokens,
  kCfgNumExperts,
  kCfgNumLocal,
  kCfgTopK,
  kCfgHidden,
  kCfgBatched,
  kCfgNumBlocks,
  kCfgRowStride,      // bytes per dispatch row: meta | payload | scales
  kCfgPayloadOffset,  // = meta bytes
  kCfgScaleOffset,
  kCfgPayloadMax,
  kCfgScaleMax,
  kCfgFlagsOffset,
  kCfgDispatchOffset0,
  kCfgDispatchOffset1,
  kCfgCombineOffset0,
  kCfgCombineOffset1,
  kCfgCombineStride,
  kCfgTimeoutNs,
  kCfgPendingPtr,    // host-mapped int32 the device sets when the error record changes
  kCfgCountInvalid,  // 1: count out-of-range ids (host validation off), 0: host checked them
  kCfgQuantFp8,
  kCfgOutDtype,      // dtype code of EPConfig.dtype (combine's transport and output)
  kCfgThreads,
  kCfgCountsOffset0,
  kCfgCountsOffset1,
  kCfgTracePtr,      // device uint64 [2 ops][num_blocks][kTraceSlots] of globaltimer stamps, or 0 (off)
  kCfgGroupFlagsOffset,  // [2][world][max_groups] u64: per group of kGroupTokens tokens (combine, prefill)
  kCfgCombineGrouped,    // combine per group (kernel_protocol.py decides when): 0 off, 1 every block
                         // sends and sums in turn, n >= 2 blocks [0, n - 1) only send and the rest only sum
  kCfgPutMode,           // 1: peers reached by NVSHMEM puts/signals from staging rows (nvshmem build only)
  kCfgStageOffset,       // put mode: [world][max_tokens] dispatch rows staged per destination
  kCfgStageCombineOffset,  // put mode: [world][max_tokens] combine partials staged per owner
  kCfgStageCountsOffset,   // put mode: [world][num_local] int32 counts staged per destination
  kCfgZeroCopy,            // 1 (standard layout): the output rows are the receive buffer's rows of
                           // dispatch half 0, where every call's rows go (the host views them)
  kCfgCombinePullInput,    // 0: combine pushes partials to their owners; else (zero copy, standard layout,
                           // peers reached by stores) this rank's address of its expert-output rows, the
                           // start of combine half 0, which peers read in place (pull)
  kCfgLen
};

// Halves of a kernel-backend call (return_recv_hook): the send half issues the stores, signals and
// advances the call number; the receive half, launched by the hook, waits and lays out / sums.
enum : int { kPhaseSend = 1, kPhaseReceive = 2, kPhaseBoth = 3 };
// Added to a dispatch's send or both phases when the host checks the ids *after* the launch (eager
// calls with validate_ids): a launch that meets an out-of-range id signals every peer an abort instead
// of its rows, so the peers raise as if this rank had abandoned the call before launching it.
constexpr int kPhaseAbandonOnInvalid = 4;

// Prefill-sized combines signal per group of kGroupTokens tokens, so the owner sums a group as soon
// as every peer's partials of it have landed instead of after every peer's whole send.
constexpr int kGroupTokens = 32;
EP_HD int max_groups(int max_tokens) { return (max_tokens + kGroupTokens - 1) / kGroupTokens; }

// Phase stamps (EP_COMM_TRACE=1, bench/kernel_trace.py): thread 0 of every block writes the
// globaltimer when its block reaches each point.  Per-source stamps exist for the first
// kTraceSources sources of a dispatch (in receive order: own, rank+1, ...).
enum : int { kTraceDispatch = 0, kTraceCombine = 1, kTraceSlots = 24, kTraceSources = 8 };
enum : int {
  kTrStart = 0,       // block entered the kernel
  kTrSent = 1,        // block finished its sends (all its warps)
  kTrArrived = 2,     // grid-wide arrival done (dispatch: every block sent)
  kTrSignalled = 3,   // the last block released the peers' flags (last block only)
  kTrSource0 = 4,     // dispatch: 4 + 2i flag of source i seen, 5 + 2i its rows laid out;
                      // combine: 4 every flag seen
  kTrEnd = 20,        // block done
};

// dtype codes shared with Python
enum : int { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

// Row meta of a dispatch row: 16-byte header, then int32 local ids [k], float weights [k] and int32
// slot indices [k] (the row's index among the rows this source sends to that local expert).
struct RowHeader {
  uint32_t code;
  int32_t payload_bytes;
  int32_t scale_bytes;
  int32_t token;
};
EP_HD int row_meta_bytes(int top_k) { return (static_cast<int>(sizeof(RowHeader)) + 12 * top_k + 15) / 16 * 16; }

constexpr int kMaxTopK = 32;

}  // namespace ep_comm
