// The dispatch's receive side: where a row goes (place_row), the checks on a peer's row, and the two
// orders of laying peers' rows out: after every source's flag (dispatch.cu), or while this rank still
// sends (receive_while_sending: the standard layout at prefill sizes).  Included by dispatch.cu.
#pragma once

#include "one_sided/kernel_common.cuh"

namespace ep_comm {
namespace EP_KERNELS {
namespace {

// Lanes j < k hold local expert id ``lid`` (-1: none), weight ``lw`` and, batched, the slot inside
// that expert of output row ``row``.  Leaves in ``dst`` / ``dst_s`` where the row's payload and scales
// go (the standard row, or one batched slot per expert) and returns how many; with ``write_ids`` also
// writes the row's ids, weights and slots.  A row whose ids are all -1 is padding: nothing to copy.
// Zero copy: the standard row ``src * max_tokens + t`` is row (src, t) of this rank's dispatch half 0,
// where source src's rows arrive, so only this rank's own rows are copied (while sending).
__device__ __forceinline__ int place_row(const DispatchParams& p, int64_t row, int lid, float lw, int slot,
                                         bool write_ids, uint8_t** dst, uint8_t** dst_s, int lane) {
  const int k = p.c.lay.top_k;
  const int64_t flat = lid >= 0 ? static_cast<int64_t>(lid) * p.capacity + slot : -1;
  if (write_ids && lane < k) {
    p.row_ids[row * k + lane] = lid;
    p.row_w[row * k + lane] = lid >= 0 ? lw : 0.f;
    if (p.c.lay.batched) p.row_slot[row * k + lane] = static_cast<int32_t>(flat);
  }
  const unsigned mask = __ballot_sync(kFull, lid >= 0);
  if (!p.c.lay.batched) {
    if (lane == 0) {
      const Layout& L = p.c.lay;
      if (L.zero_copy) {
        uint8_t* r = peer_ptr(p.c, L.rank) + L.dispatch_offset[0] + row * L.row_stride;
        dst[0] = r + L.payload_offset;
        dst_s[0] = p.scale_bytes ? r + L.scale_offset : nullptr;
      } else {
        dst[0] = static_cast<uint8_t*>(p.out_x) + row * p.payload_bytes;
        dst_s[0] = p.scale_bytes ? static_cast<uint8_t*>(p.out_scales) + row * p.scale_bytes : nullptr;
      }
    }
    __syncwarp();
    return mask ? 1 : 0;
  }
  if (lid >= 0) {
    const int j = __popc(mask & lanes_below(lane));
    dst[j] = static_cast<uint8_t*>(p.out_x) + flat * p.payload_bytes;
    dst_s[j] = p.scale_bytes ? static_cast<uint8_t*>(p.out_scales) + flat * p.scale_bytes : nullptr;
  }
  __syncwarp();
  return __popc(mask);
}


// Set in a row header's payload_bytes by a sender that wrote the header after the row's bytes (receive
// while sending, below): the row may be laid out before its source's flag.  Without it (a sender that
// split rows into pieces, which each rank chooses by its own token count) only after the flag.
constexpr uint32_t kRowLanded = 1u << 31;
// Set with kRowLanded, payload bytes 0, by a sender receiving while sending in the header of its row
// for a peer that token t does not go to: no row comes there this call, so that peer's receiving warps
// move past it instead of waiting for the sender's flag (at EP4 about one token in ten skips a peer).
constexpr uint32_t kRowAbsent = 1u << 30;

// A row header's first 8 bytes, {code, payload_field}, as one word: written last and alone.
__device__ __forceinline__ void write_row_code(void* header, uint32_t code, uint32_t payload_field) {
  *static_cast<volatile uint64_t*>(header) = static_cast<uint64_t>(code) | static_cast<uint64_t>(payload_field) << 32;
}

// Whether a peer's row header (call code, payload and scale bytes) belongs to this call and has this
// rank's widths; another width is recorded against the peer when ``report``.
__device__ __forceinline__ bool header_matches(const DispatchParams& p, uint32_t row_code, int32_t payload_field,
                                               int32_t scale_bytes, uint32_t code, int src, bool report,
                                               const ErrorSink& err) {
  if (row_code != code || (static_cast<uint32_t>(payload_field) & kRowAbsent)) return false;
  const uint32_t payload_bytes = static_cast<uint32_t>(payload_field) & ~kRowLanded;
  if (payload_bytes == p.payload_bytes && scale_bytes == p.scale_bytes) return true;
  if (report) {
    err.peer(src, kReasonFormat, payload_bytes, static_cast<uint32_t>(p.payload_bytes));
    err.count(kStatusRowFormat, 1);
  }
  return false;
}

// Zero copy, standard layout: the local ids and weights of received row ``row_index`` (its header and
// meta at ``row``; ``live``: below the source's token count), by one lane.  A row of another call or
// of another width is dropped (-1), the latter recorded as a format error.  With k a multiple of 4 the
// meta moves in 16-byte pieces: a warp's lanes hold rows the grid's warp count apart, so each load or
// store instruction is 32 transactions, and 4-byte ones issued 4x as many.
__device__ __forceinline__ void receive_row_meta(const DispatchParams& p, const uint8_t* row, int64_t row_index,
                                                 bool live, uint32_t code, int src, const ErrorSink& err) {
  const int k = p.c.lay.top_k, nl = p.c.lay.num_local;
  bool valid = false;
  if (live) {
    const int4 h = ld_cg(reinterpret_cast<const int4*>(row));  // RowHeader
    valid = header_matches(p, static_cast<uint32_t>(h.x), h.y, h.z, code, src, true, err);
  }
  const int32_t* meta = reinterpret_cast<const int32_t*>(row + sizeof(RowHeader));
  const float* weights = reinterpret_cast<const float*>(meta + k);
  int32_t* out_ids = p.row_ids + row_index * k;
  float* out_w = p.row_w + row_index * k;
  // never trust an id from another process: out of range means dropped
  auto keep = [nl](int lid) { return lid >= 0 && lid < nl; };
  const bool vec = (k & 3) == 0 &&
                   ((reinterpret_cast<uintptr_t>(row) | reinterpret_cast<uintptr_t>(out_ids) |
                     reinterpret_cast<uintptr_t>(out_w)) & 15) == 0;
  if (vec) {
    for (int j = 0; j < k; j += 4) {
      int4 id = make_int4(-1, -1, -1, -1);
      float4 w = make_float4(0.f, 0.f, 0.f, 0.f);
      if (valid) {
        id = ld_cg(reinterpret_cast<const int4*>(meta + j));
        w = __ldcg(reinterpret_cast<const float4*>(weights + j));
      }
      const bool kx = keep(id.x), ky = keep(id.y), kz = keep(id.z), kw = keep(id.w);
      *reinterpret_cast<int4*>(out_ids + j) = make_int4(kx ? id.x : -1, ky ? id.y : -1, kz ? id.z : -1, kw ? id.w : -1);
      *reinterpret_cast<float4*>(out_w + j) = make_float4(kx ? w.x : 0.f, ky ? w.y : 0.f, kz ? w.z : 0.f, kw ? w.w : 0.f);
    }
    return;
  }
  for (int j0 = 0; j0 < k; j0 += 8) {
    int lid[8];
    float w[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {  // every load of the group before any store (which may alias them)
      const bool here = valid && j0 + u < k;
      lid[u] = here ? __ldcg(meta + j0 + u) : -1;
      w[u] = here ? __ldcg(weights + j0 + u) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (j0 + u >= k) break;
      out_ids[j0 + u] = keep(lid[u]) ? lid[u] : -1;
      out_w[j0 + u] = keep(lid[u]) ? w[u] : 0.f;
    }
  }
}


// Piece ``chunk`` of peer row ``row_index`` (its bytes at ``row``; ``valid``: its header checked, else
// the row is padding) into its places: with piece 0 the row's ids, weights and slots and the scales,
// then the piece's payload bytes.  Batched: ``count`` and ``base`` are [world][num_local] rows each
// source sent to each local expert and the first slot of them; null (receiving while sending, before
// any count is known), each expert's next free slot, in the order rows land: p.send_count's own row,
// which this rank's own rows take their slots from as they are sent (the order inside an expert is the
// backend's to choose).  Ids and slots from another process are never trusted: out of range means
// dropped.
__device__ __forceinline__ void lay_out_piece(const DispatchParams& p, const uint8_t* row, int64_t row_index, int src,
                                              int chunk, bool valid, const int* count, const int* base,
                                              uint8_t** dst, uint8_t** dst_s, int lane) {
  const Layout& L = p.c.lay;
  const int k = L.top_k, nl = L.num_local;
  int lid = -1, slot = -1;
  float lw = 0.f;
  if (valid && lane < k) {
    const int32_t* meta = reinterpret_cast<const int32_t*>(row + sizeof(RowHeader));
    lid = __ldcg(meta + lane);
    lw = __ldcg(reinterpret_cast<const float*>(meta + k) + lane);
    if (lid < 0 || lid >= nl) {
      lid = -1;
    } else if (L.batched && count == nullptr) {
      slot = atomicAdd(p.send_count + L.rank * nl + lid, 1);
      if (slot >= p.capacity) lid = -1;  // only more rows than max_tokens from one source get here
    } else if (L.batched) {
      const int idx = __ldcg(meta + 2 * k + lane);
      if (idx < 0 || idx >= count[src * nl + lid]) lid = -1;
      else slot = base[src * nl + lid] + idx;
    }
  }
  const int n = place_row(p, row_index, lid, lw, slot, chunk == 0, dst, dst_s, lane);
  if (n == 0) return;
  const int64_t lo = chunk * p.chunk_bytes;
  const int64_t hi = min(p.payload_bytes, lo + p.chunk_bytes);
  if (lane < n) dst[lane] += lo;
  __syncwarp();
  warp_copy_multi<true>(row + L.payload_offset + lo, dst, n, hi - lo, lane);
  if (chunk == 0 && p.scale_bytes > 0) warp_copy_multi<true>(row + L.scale_offset, dst_s, n, p.scale_bytes, lane);
  __syncwarp();
}

// lay_out_piece for a piece of at most kPrefetchPieceBytes after the sources' flags: the header, the
// meta and the payload (and piece 0's scales) are loaded together before any of them is looked at, so
// a decode-sized piece waits out one load latency instead of header -> meta -> payload.  A row that
// turns out not to belong to the call drops what was loaded.  ``live``: the row is below its source's
// token count.  The host sets p.prefetch_pieces only where every piece, its places and the scales are
// 16-byte aligned and the scales fit one vector a lane.
__device__ __forceinline__ void lay_out_prefetched(const DispatchParams& p, const uint8_t* row, int64_t row_index,
                                                   int src, int chunk, bool live, const int* count, const int* base,
                                                   uint32_t code, const ErrorSink& err, uint8_t** dst,
                                                   uint8_t** dst_s, int lane) {
  const Layout& L = p.c.lay;
  const int k = L.top_k, nl = L.num_local;
  const int64_t lo = chunk * p.chunk_bytes;
  const int64_t bytes = min(p.payload_bytes, lo + p.chunk_bytes) - lo;
  const uint8_t* payload = row + L.payload_offset + lo;
  const uint8_t* scales = row + L.scale_offset;
  const bool with_scales = chunk == 0 && p.scale_bytes > 0;
  const int nv = static_cast<int>(bytes >> 4);
  int4 h = make_int4(0, 0, 0, 0), sv = make_int4(0, 0, 0, 0);
  int4 v[kPrefetchVecs];
  int lid = -1, idx = -1;
  float lw = 0.f;
  if (live) {
    h = ld_cg(reinterpret_cast<const int4*>(row));
    if (lane < k) {
      const int32_t* meta = reinterpret_cast<const int32_t*>(row + sizeof(RowHeader));
      lid = __ldcg(meta + lane);
      lw = __ldcg(reinterpret_cast<const float*>(meta + k) + lane);
      if (L.batched) idx = __ldcg(meta + 2 * k + lane);
    }
#pragma unroll
    for (int u = 0; u < kPrefetchVecs; ++u)
      if (lane + u * kWarpSize < nv) v[u] = ld_cg(reinterpret_cast<const int4*>(payload) + lane + u * kWarpSize);
    if (with_scales && lane * 16 < p.scale_bytes) sv = ld_cg(reinterpret_cast<const int4*>(scales) + lane);
  }
  const bool valid = live && header_matches(p, static_cast<uint32_t>(h.x), h.y, h.z, code, src,
                                            lane == 0 && chunk == 0, err);
  if (!valid && chunk > 0) return;
  int slot = -1;
  if (!valid || lid < 0 || lid >= nl) {
    lid = -1;
  } else if (L.batched) {
    if (idx < 0 || idx >= count[src * nl + lid]) lid = -1;
    else slot = base[src * nl + lid] + idx;
  }
  const int n = place_row(p, row_index, lid, lw, slot, chunk == 0, dst, dst_s, lane);
  if (n == 0) return;
  for (int d = 0; d < n; ++d) {
    int4* o = reinterpret_cast<int4*>(dst[d] + lo);
#pragma unroll
    for (int u = 0; u < kPrefetchVecs; ++u)
      if (lane + u * kWarpSize < nv) o[lane + u * kWarpSize] = v[u];
    if (with_scales && lane * 16 < p.scale_bytes) reinterpret_cast<int4*>(dst_s[d])[lane] = sv;
  }
  __syncwarp();
}

// ---- receive while sending ------------------------------------------------------------------------
// At prefill sizes the standard layout's copy of the peers' rows (memory-bound) can run beside the
// sends (link- or, quantising, instruction-bound) instead of after them; so can the batched layout's
// expansion into expert slots, its slots taken in the order rows land (lay_out_piece).  A row is then laid out as
// soon as its header carries the call's code marked kRowLanded, so the sender writes the code last:
// the header's second half {scale_bytes, token} goes with the row, its first half {code,
// payload_bytes | kRowLanded} after a system-scope fence that orders the row's bytes before it.  A send
// warp fences once for the rows of a few tokens: a fence per row cost the sends 18 % on 24 SMs, one per
// 4 rows 2-4 % (bench/microbench/overlap_recv.cu), while rows sent but not yet marked leave the
// receiving warps waiting.  A token sends about one row to each other rank, so the warp marks after
// about kMarkRows rows: every 4 tokens at EP2, every token from EP4 on (docs/performance.md).
constexpr int kMarkRows = 4;
__device__ __forceinline__ int tokens_per_mark(int world) { return max(1, kMarkRows / max(1, world - 1)); }

// The rows a send warp has sent but not yet marked, in shared memory: the send loop keeps its registers.
struct RowMarks {
  uint64_t** head;  // [kWarpSize] the rows' headers
  int* count;       // tokens since the last fence << 8 | their rows (one per remote destination)
  int every;        // tokens marked at once (tokens_per_mark)

  // Rows dst[0 .. n) (their payloads; the header is payload_offset before) of one token.
  __device__ __forceinline__ void add(uint8_t* const* dst, int n, int64_t payload_offset, int lane) {
    const int c = *count;
    if (lane < n) head[(c & 0xff) + lane] = reinterpret_cast<uint64_t*>(dst[lane] - payload_offset);
    __syncwarp();
    if (lane == 0) *count = c + (1 << 8) + n;
    __syncwarp();
  }
  // Whether to mark now: ``every`` tokens, or too few lanes left for another token's ``room`` rows.
  __device__ __forceinline__ bool due(int room) const {
    const int c = *count;
    return (c >> 8) >= every || (c & 0xff) + room > kWarpSize;
  }
  // The fence, then every pending row's code word: the call's code and the payload bytes, landed.
  __device__ __forceinline__ void mark(uint32_t code, int64_t payload_bytes, int lane) {
    const int c = *count;
    if (c == 0) return;
    __syncwarp();
    __threadfence_system();
    if (lane < (c & 0xff))
      write_row_code(head[lane], code, static_cast<uint32_t>(payload_bytes) | kRowLanded);
    __syncwarp();
    if (lane == 0) *count = 0;
    __syncwarp();
  }
};

// Token t's header at every active peer it does not go to (``dst_rank[0 .. n)``: the ones it goes to)
// says so: {code, kRowLanded | kRowAbsent}.  No bytes come with it, so no fence orders it.
__device__ __forceinline__ void mark_absent(const DispatchParams& p, uint32_t code, int64_t row_off,
                                            const int* dst_rank, int n, int lane) {
  const Layout& L = p.c.lay;
  for (int q = lane; q < L.world; q += kWarpSize) {
    if (q == L.rank || !peer_active(L, q)) continue;
    bool goes = false;
    for (int i = 0; i < n; ++i) goes |= dst_rank[i] == q;
    if (!goes) write_row_code(peer_ptr(p.c, q) + row_off, code, kRowLanded | kRowAbsent);
  }
}

// Traced (EP_COMM_TRACE=1): what a block's receiving warps did while its send warps still sent, in
// shared memory; the send warps write it to the stamps (Stamp.ROWS_BY_SENT, WAITED_BY_SENT) on arrival.
struct ReceiveProgress {
  int rows;                      // rows laid out
  int sending;                   // 1 until the block's send warps arrive
  unsigned long long waited_ns;  // waits for a row that ended while the block sent, summed over warps
};

// A source's token count as receive_while_sending keeps it per block: not known before its flag is seen.
constexpr int kUnknownTokens = -2;

// This rank's slot of source ``src``'s call flag (parity ``parity``).
__device__ __forceinline__ const uint64_t* source_flag(const DispatchParams& p, int parity, int src) {
  const Layout& L = p.c.lay;
  return reinterpret_cast<const uint64_t*>(peer_ptr(p.c, L.rank) + L.flags_offset) + parity * L.world + src;
}

// Lane 0: one look at source ``src``'s call flag.  Its token count once the flag carries the call's
// code (kept in ``tokens[src]`` and stamped), -1 when it shows the source on another call (recorded)
// or announces more tokens than fit, kUnknownTokens while neither.
__device__ int look_at_source(const DispatchParams& p, int parity, int src, uint32_t code, int* tokens,
                              const ErrorSink& err) {
  const Layout& L = p.c.lay;
  const uint64_t v = ld_acquire_sys(source_flag(p, parity, src));
  int n = kUnknownTokens;
  bool overflow = false;
  if (static_cast<uint32_t>(v) == code && !(v & kVerdictMark)) {
    overflow = static_cast<int64_t>(v >> 32) > L.max_tokens;
    n = overflow ? -1 : static_cast<int>(v >> 32);
  } else if (on_other_call(static_cast<uint32_t>(v), code, src, err)) {
    n = -1;
  }
  if (n != kUnknownTokens && atomicCAS(tokens + src, kUnknownTokens, n) == kUnknownTokens) {
    if (overflow && blockIdx.x == 0) err.count(kStatusOverflow, 1);
    const int i = (src - L.rank + L.world) % L.world;
    if (i < kTraceSources && L.trace != nullptr)
      L.trace[(static_cast<int64_t>(kTraceDispatch) * gridDim.x + blockIdx.x) * kTraceSlots + kTrSource0 + 2 * i] =
          global_timer_ns();
  }
  return n;
}

// Lane 0: whether peer row (src, t) at ``row`` belongs to this call, waiting until its header carries
// the call's code marked landed, or the source's flag has come (the row is then as the flag left it:
// a source that did not receive while sending marks none) or says the source left the call.  A source
// silent past the deadline is recorded once per block and its rows are padding.
__device__ bool await_row(const DispatchParams& p, int parity, const uint8_t* row, int t, int src, uint32_t code,
                          int* tokens, uint64_t deadline, const ErrorSink& err) {
  const uint64_t* head = reinterpret_cast<const uint64_t*>(row);
  uint64_t h = 0;
  uint32_t spins = 0;
  while (true) {
    h = ld_acquire_sys(head);
    if (static_cast<uint32_t>(h) == code && (static_cast<uint32_t>(h >> 32) & kRowLanded)) break;
    int n = *reinterpret_cast<volatile int*>(tokens + src);
    if (n == kUnknownTokens) n = look_at_source(p, parity, src, code, tokens, err);
    else if (n >= 0) ld_acquire_sys(source_flag(p, parity, src));  // another warp saw it: acquire it here too
    if (n != kUnknownTokens) {
      if (t >= n) return false;
      h = ld_acquire_sys(head);  // released before the flag
      break;
    }
    if ((++spins & 63u) == 0 && global_timer_ns() > deadline) {
      if (atomicCAS(tokens + src, kUnknownTokens, -1) == kUnknownTokens) {  // (the flag's code: what it did last)
        err.peer(src, kReasonTimeout, static_cast<uint32_t>(ld_acquire_sys(source_flag(p, parity, src))), code);
        err.count(kStatusTimeouts, 1);
      }
      return false;
    }
    __nanosleep(128);  // the block's send warps need the issue slots
  }
  const int2 rest = __ldcg(reinterpret_cast<const int2*>(row) + 1);  // {scale_bytes, token}
  return header_matches(p, static_cast<uint32_t>(h), static_cast<int32_t>(h >> 32), rest.x, code, src, true, err);
}

// The peers' rows [world - 1][max_tokens], t-major over the sources (they all send in token order), go
// to this block's warps as they ask: block b takes every gridDim.x-th row, ``next`` is the block's
// ticket counter (shared).  ``tokens``: [world] per block, kUnknownTokens for each active peer at the
// start.  ``progress``: null unless traced.
__device__ void receive_while_sending(const DispatchParams& p, uint32_t code, int parity, int data_half, int* next,
                                      int* tokens, uint8_t** dst, uint8_t** dst_s, uint64_t deadline,
                                      const ErrorSink& err, ReceiveProgress* progress, int lane) {
  const Layout& L = p.c.lay;
  const int sources = L.world - 1;
  const int64_t items = static_cast<int64_t>(sources) * L.max_tokens;
  const uint8_t* const rows = peer_ptr(p.c, L.rank) + L.dispatch_offset[data_half];
  while (true) {
    int64_t i = 0;
    if (lane == 0) i = blockIdx.x + static_cast<int64_t>(atomicAdd(next, 1)) * gridDim.x;
    i = __shfl_sync(kFull, i, 0);
    if (i >= items) return;
    const int t = static_cast<int>(i / sources);
    const int src = (L.rank + 1 + static_cast<int>(i % sources)) % L.world;
    const int64_t row_index = static_cast<int64_t>(src) * L.max_tokens + t;
    const uint8_t* row = rows + row_index * L.row_stride;
    int valid = 0;
    if (lane == 0) {
      const uint64_t t0 = progress != nullptr ? global_timer_ns() : 0;
      valid = await_row(p, parity, row, t, src, code, tokens, deadline, err);
      if (progress != nullptr && *reinterpret_cast<volatile int*>(&progress->sending))
        atomicAdd(&progress->waited_ns, static_cast<unsigned long long>(global_timer_ns() - t0));
    }
    valid = __shfl_sync(kFull, valid, 0);
    __syncwarp();  // lane 0's acquire before every lane's loads
    lay_out_piece(p, row, row_index, src, 0, valid != 0, nullptr, nullptr, dst, dst_s, lane);
    if (progress != nullptr && lane == 0) atomicAdd(&progress->rows, 1);
  }
}

}  // namespace
}  // namespace EP_KERNELS
}  // namespace ep_comm
