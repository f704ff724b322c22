// What the one-sided kernels and the Python layer share.  The numbers (config slots, error record,
// host-mapped words, phases, limits) come from protocol_table.h, which setup.py generates from
// ep_comm/backends/protocol.py; this header adds the logic around them.
#pragma once

#include <cstdint>

#include "common/protocol_table.h"

#if defined(__CUDACC__)
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD inline
#endif

namespace ep_comm {

// A flag word is 64 bits: low 32 = code(seq, op), high 32 = the sender's token count.
// seq counts this communicator's kernel calls; every rank advances it identically, so a peer whose
// code carries the same seq but another op, or a later seq, is on another call.
constexpr uint32_t kSeqMask = (1u << kSeqBits) - 1u;

EP_HD uint32_t make_code(uint64_t seq, uint32_t op) {
  return (static_cast<uint32_t>(seq & kSeqMask) << 2) | op;
}
EP_HD uint32_t code_seq(uint32_t code) { return code >> 2; }
EP_HD uint32_t code_op(uint32_t code) { return code & 3u; }
// ``code`` belongs to a call after ``expected`` (modulo the call number's wrap).
EP_HD bool code_ahead(uint32_t code, uint32_t expected) {
  const uint32_t d = (code_seq(code) - code_seq(expected)) & kSeqMask;
  return d != 0 && d < (kSeqMask >> 1);
}

// int32 words of the error record: kStatusRankReason + [world] reasons + [world] codes seen.
EP_HD int status_words(int world) { return kStatusRankReason + 2 * world; }

// Prefill-sized combines signal per group of kGroupTokens tokens, so the owner sums a group as soon
// as every peer's partials of it have landed instead of after every peer's whole send.
EP_HD int max_groups(int max_tokens) { return (max_tokens + kGroupTokens - 1) / kGroupTokens; }

// Head of a dispatch row; int32 local ids [k], float weights [k] and int32 slot indices [k] (the row's
// index among the rows this source sends to that local expert) follow, then payload and scales.  The
// top bit of payload_bytes marks a row whose header was written after its bytes (kRowLanded), the
// next one a row that does not come this call (kRowAbsent; both in one_sided/dispatch_receive.cuh).
struct RowHeader {
  uint32_t code;
  int32_t payload_bytes;
  int32_t scale_bytes;
  int32_t token;
};
static_assert(sizeof(RowHeader) == kRowHeaderBytes, "RowHeader must match Limit.ROW_HEADER_BYTES");

}  // namespace ep_comm
