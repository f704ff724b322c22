// One-sided dispatch: one launch per call (send, signal, wait, lay out), or two with a receive hook
// (phases in protocol.h).
#include <algorithm>
#include <array>
#include <mutex>
#include <type_traits>

#include "common/quantise.cuh"
#include "one_sided/dispatch_receive.cuh"
#include "one_sided/kernel_common.cuh"

namespace ep_comm {
namespace EP_KERNELS {

namespace {

// ---- dispatch ----------------------------------------------------------------------------------------
// Routing of one token, computed by the warp that sends it: lane j < k owns slot j.
struct Route {
  int keep;        // slot j holds the first occurrence of a valid expert id
  int owner_rank;  // -1 unless keep
  int local;       // local expert index on owner_rank
  float weight;    // merged weight of every occurrence of the id (0 unless keep)
  unsigned leaders;  // lanes holding the first slot of each distinct destination rank
  int num_dest;
};

template <bool kIds64>
__device__ __forceinline__ Route route_token(const DispatchParams& p, int t, int lane, bool count_invalid,
                                             const ErrorSink& err) {
  const int k = p.c.lay.top_k;
  long long raw = -1;
  float w = 0.f;
  if (lane < k) {
    raw = kIds64 ? static_cast<const int64_t*>(p.ids)[static_cast<int64_t>(t) * k + lane]
                 : static_cast<const int32_t*>(p.ids)[static_cast<int64_t>(t) * k + lane];
    w = p.weights[static_cast<int64_t>(t) * k + lane];
  }
  const bool invalid = lane < k && (raw < -1 || raw >= p.c.lay.num_experts);
  const int id = invalid ? -1 : static_cast<int>(raw);
  const bool valid = lane < k && id >= 0;
  float merged = 0.f;
  bool dup = false;
  for (int j = 0; j < k; ++j) {  // slot order, so merged weights add up like the oracle's
    const int other = __shfl_sync(kFull, id, j);
    const float ow = __shfl_sync(kFull, w, j);
    if (valid && other == id) {
      merged += ow;
      if (j < lane) dup = true;
    }
  }
  Route r;
  const int owner = valid && !dup ? __ldg(p.expert_owner + id) : -1;
  r.keep = owner >= 0;  // negative: the expert's rank left (shrink), the pair is dropped
  r.owner_rank = r.keep ? (owner >> 16) : -1;
  r.local = r.keep ? (owner & 0xffff) : -1;
  r.weight = r.keep ? merged : 0.f;
  bool leader = r.keep;
  for (int j = 0; j < k; ++j) {
    const int other = __shfl_sync(kFull, r.owner_rank, j);
    if (j < lane && other == r.owner_rank) leader = false;
  }
  r.leaders = __ballot_sync(kFull, leader);
  r.num_dest = __popc(r.leaders);
  if (invalid && count_invalid) err.count(kStatusInvalidIds, 1);
  return r;
}

// The dispatch kernel's kQuant: -1 copies x (and carried x_scales) as they are; otherwise x is
// quantised on the way out, from the input dtype kQuantIn<kQuant>, to fp8 (kQuant < kDispatchNvfp4) or
// NVFP4 (one_sided.cuh).
template <int kQuant>
constexpr bool kIsNvfp4 = kQuant >= kDispatchNvfp4;
template <int kQuant>
constexpr int kQuantIn = kIsNvfp4<kQuant> ? kQuant - kDispatchNvfp4 : kQuant;

// Bytes [lo, hi) of token t's wire payload (quantised from x when kQuant >= 0) to ``nd`` rows whose
// payload starts at dst[i] and scales at dst_s[i]; a quantised piece carries its own blocks' scales,
// a copied row's piece with lo == 0 all of its carried scales.
template <int kQuant>
__device__ __forceinline__ void send_payload(const DispatchParams& p, int t, int64_t lo, int64_t hi, uint8_t** dst,
                                             uint8_t** dst_s, int nd, int lane, uint8_t* quant_stage) {
  constexpr int kIn = kQuantIn<kQuant>;
  using QuantIn = typename std::conditional<kIn == kFp16, __half,
                  typename std::conditional<kIn == kFp32, float, __nv_bfloat16>::type>::type;
  if (nd == 0) return;
  // payload byte lo is channel lo (fp8) or 2 * lo (NVFP4, two per byte); the host splits rows at
  // multiples of 256 channels, so scale blocks (128 channels, 16) never straddle pieces
  if (lane < nd) {
    dst[lane] += lo;
    if (kIsNvfp4<kQuant>) dst_s[lane] += lo / (kNvfp4Block / 2);
    else if (kQuant >= 0) dst_s[lane] = reinterpret_cast<uint8_t*>(reinterpret_cast<float*>(dst_s[lane]) + lo / 128);
  }
  __syncwarp();
  if (kQuant >= 0) {
    const QuantIn* row = reinterpret_cast<const QuantIn*>(static_cast<const uint8_t*>(p.x) + static_cast<int64_t>(t) * p.x_row_bytes);
    if (kIsNvfp4<kQuant>) {
      warp_quant_nvfp4_multi<QuantIn>(row + 2 * lo, static_cast<int>(2 * (hi - lo)), __ldg(p.global_scale), dst, dst_s,
                                      nd, lane, quant_stage);
    } else {
      warp_quant_fp8_multi<QuantIn>(row + lo, static_cast<int>(hi - lo), dst, reinterpret_cast<float* const*>(dst_s), nd,
                                    lane, quant_stage);
    }
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(p.x) + static_cast<int64_t>(t) * p.x_row_bytes + lo;
    // zero copy with x already in this rank's own rows (Communicator.dispatch_input_buffer): the own
    // share's destination (the last one) is the source itself, nothing to move there
    warp_copy_multi<false>(src, dst, dst[nd - 1] == src ? nd - 1 : nd, hi - lo, lane);
    if (lo == 0 && p.scale_bytes > 0) {
      const uint8_t* ssrc = static_cast<const uint8_t*>(p.x_scales) + static_cast<int64_t>(t) * p.scale_bytes;
      warp_copy_multi<false>(ssrc, dst_s, nd, p.scale_bytes, lane);
    }
  }
  __syncwarp();
}

__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ bool wait_u32(const uint32_t* p, uint32_t want, uint64_t deadline, const ErrorSink& err) {
  uint32_t spins = 0;
  while (true) {
    if (ld_acquire_gpu_u32(p) == want) return true;
    if ((++spins & 255u) == 0 && global_timer_ns() > deadline) {
      err.count(kStatusLocalStall, 1);
      return false;
    }
  }
}

// put mode: offset of the staging row of (destination, token) in this rank's buffer
__device__ __forceinline__ int64_t stage_row_off(const Layout& L, int dest, int t) {
  return L.stage_offset + (static_cast<int64_t>(dest) * L.max_tokens + t) * L.row_stride;
}

// put mode: what this warp just wrote into the staging rows of its ``nd`` destinations (``dest_rank``),
// to the row at ``row_off`` of each: the meta with piece 0, payload bytes [lo, hi) and their scales
// (fp8 and NVFP4: the piece's own scale blocks; carried scales: all of them with piece 0).
template <int kQuant>
__device__ __forceinline__ void put_staged_piece(const DispatchParams& p, int64_t row_off, int t, int chunk,
                                                 int64_t lo, int64_t hi, const int* dest_rank, int nd) {
  const Layout& L = p.c.lay;
  int64_t s_lo = 0, s_hi = 0;
  if (kIsNvfp4<kQuant>) {  // one scale byte per 8 payload bytes; hi is a multiple of 8 (hidden % 16 == 0)
    s_lo = lo / (kNvfp4Block / 2);
    s_hi = hi / (kNvfp4Block / 2);
  } else if (kQuant >= 0) {
    s_lo = lo / 128 * 4;
    s_hi = (hi + 127) / 128 * 4;
  } else if (chunk == 0) {
    s_hi = p.scale_bytes;
  }
  for (int i = 0; i < nd; ++i) {
    const int d = dest_rank[i];
    const int64_t stage = stage_row_off(L, d, t);
    if (chunk == 0) put_warp(p.c, row_off, L.payload_offset, stage, d);
    put_warp(p.c, row_off + L.payload_offset + lo, hi - lo, stage + L.payload_offset + lo, d);
    put_warp(p.c, row_off + L.scale_offset + s_lo, s_hi - s_lo, stage + L.scale_offset + s_lo, d);
  }
}

// kOverlap: receive while sending (p.receive_warps > 0); a kernel of its own, so that the decode
// kernel carries none of its code.
template <int kQuant, bool kIds64, bool kOverlap>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchParams p) {
  const Layout& L = p.c.lay;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp;
  const int nwarps = gridDim.x * kWarps;
  const int k = L.top_k;
  const int nl = L.num_local;
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  const ErrorSink err{p.c.status, L.pending, L.world};
  const auto [seq, code, parity] = current_call(p.c, kOpDispatch, p.phases);
  // the input verdict queued in front of this launch found bad input on some rank: every rank's launch
  // skips the call alike (no rows, no signals), so the call numbers stay in step and the next call runs
  if (p.checked && (p.phases & kPhaseSend) &&
      *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateVerdict) != 0ull) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;
    return;
  }
  // zero copy keeps every call's rows in half 0: the host's views of them must not move between calls
  // (the rows of call n are consumed before the combine of call n, which every peer's call n + 1 waits
  // for; the host refuses a dispatch before the combine of the previous one)
  const int data_half = L.zero_copy ? 0 : parity;
  stamp(L, kTraceDispatch, kTrStart);

  __shared__ uint8_t* s_dst[kWarps][kMaxTopK];    // per warp: destination payloads
  __shared__ uint8_t* s_dst_s[kWarps][kMaxTopK];  // per warp: destination scales
  __shared__ int s_dst_rank[kWarps][kMaxTopK];
  // dynamic shared memory: while sending, the quantising kernels' per-warp stages (their rows leave
  // through them 16 bytes per lane: quantise.cuh, store_staged); while receiving, [world] token counts and
  // [world][num_local] counts and slot bases.  grid_arrive's barrier lies between the two uses.  Receiving
  // while sending (copied rows: no stages), [world] token counts from the start.
  extern __shared__ __align__(16) int s_prefix[];
  uint8_t* const quant_stage = kQuant >= 0 ? reinterpret_cast<uint8_t*>(s_prefix) + warp * kQuantStageBytes : nullptr;
  uint8_t** dst = s_dst[warp];
  uint8_t** dst_s = s_dst_s[warp];
  // receive while sending (dispatch_receive.cuh; the host chooses it and how many): the block's last
  // p.receive_warps warps lay the peers' rows out from the start, the others send and then join them.
  // Their per-block state: each source's token count (dynamic shared memory, after the quantiser's stages
  // when there are any) and the row tickets.
  static_assert(!kOverlap || kQuant < 0 || kQuant == kBf16, "receiving while sending: copied rows or fp8 from bf16 (ops.h)");
  const int receive_warps = kOverlap ? p.receive_warps : 0;
  const int send_warps = kWarps - receive_warps;
  __shared__ int s_next_row;
  __shared__ ReceiveProgress s_progress;
  ReceiveProgress* const progress = kOverlap && L.trace != nullptr ? &s_progress : nullptr;
  int* const s_src_tokens = s_prefix + (kOverlap && kQuant >= 0 ? kWarps * kQuantStageBytes / static_cast<int>(sizeof(int)) : 0);
  if constexpr (kOverlap) {
    for (int i = threadIdx.x; i < L.world; i += blockDim.x)
      s_src_tokens[i] = i != L.rank && peer_active(L, i) ? kUnknownTokens : -1;
    if (threadIdx.x == 0) {
      s_next_row = 0;
      s_progress = ReceiveProgress{0, 1, 0ull};
    }
    __syncthreads();
    if (warp >= send_warps) {
      const int rwarp = blockIdx.x * receive_warps + warp - send_warps, nrwarps = gridDim.x * receive_warps;
      for (int t = p.num_tokens + rwarp; t < L.max_tokens; t += nrwarps)  // this rank's padding rows
        place_row(p, static_cast<int64_t>(L.rank) * L.max_tokens + t, -1, 0.f, -1, true, dst, dst_s, lane);
    }
  }

  if ((p.phases & kPhaseSend) && warp < send_warps) {
    // ---- send: one copy of each token per remote destination rank, at [this rank][t] of its region, in
    // p.chunks pieces sent by different warps; this rank's own share goes straight into the output
    const int64_t items = static_cast<int64_t>(p.num_tokens) * p.chunks;
    const WorkQueue work{p.c.counters + kStateDispatchWork, code, gridDim.x * send_warps, items};
    __shared__ uint64_t* s_mark_head[kWarps][kWarpSize];
    __shared__ int s_mark_count[kWarps];
    if (kOverlap && lane == 0) s_mark_count[warp] = 0;  // (the warp syncs before its first add)
    // receive while sending: rows whose code is still to be written
    RowMarks marks{s_mark_head[warp], s_mark_count + warp, tokens_per_mark(L.world)};
    open_work(work);
    for (int64_t item = blockIdx.x * send_warps + warp; item < items; item = next_work(work, lane, deadline, err)) {
      const int t = static_cast<int>(item / p.chunks);
      const int chunk = static_cast<int>(item % p.chunks);
      const Route r = route_token<kIds64>(p, t, lane, chunk == 0, err);
      const bool leader = r.keep && ((r.leaders >> lane) & 1u);
      const bool remote = leader && r.owner_rank != L.rank;
      const unsigned remote_mask = __ballot_sync(kFull, remote);
      const int n_remote = __popc(remote_mask);
      const bool own = r.keep && r.owner_rank == L.rank;
      const bool has_own = __ballot_sync(kFull, own) != 0;
      int slot = -1;  // index of this (token, expert) among the rows sent to that expert
      if (chunk == 0) {
        if (leader) p.dest[static_cast<int64_t>(t) * k + __popc(r.leaders & lanes_below(lane))] = r.owner_rank;
        if (lane >= r.num_dest && lane < k) p.dest[static_cast<int64_t>(t) * k + lane] = -1;
        // batched slots need each (destination, expert)'s row numbering; the standard layout does not
        if (r.keep && L.batched) slot = atomicAdd(p.send_count + r.owner_rank * nl + r.local, 1);
        if (L.batched && p.chunks > 1 && has_own) {  // the other pieces' warps need the own slots
          if (lane < k) p.self_slot[static_cast<int64_t>(t) * k + lane] = own ? slot : -1;
          __syncwarp();
          if (lane == 0) {
            __threadfence();
            atomicExch(p.self_ready + t, code);
          }
        }
      }
      // the row's offset in its owner's buffer; put mode writes it to this rank's staging row first
      const int64_t row_off =
          L.dispatch_offset[data_half] + (static_cast<int64_t>(L.rank) * L.max_tokens + t) * L.row_stride;
      if (remote) {
        const int i = __popc(remote_mask & lanes_below(lane));
        uint8_t* row = put_mode(L) ? own_at(p.c, stage_row_off(L, r.owner_rank, t))
                                   : peer_ptr(p.c, r.owner_rank) + row_off;
        dst[i] = row + L.payload_offset;
        dst_s[i] = row + L.scale_offset;
        s_dst_rank[warp][i] = r.owner_rank;
      }
      __syncwarp();
      if constexpr (kOverlap) {
        mark_absent(p, code, row_off, s_dst_rank[warp], n_remote, lane);
        marks.add(dst, n_remote, L.payload_offset, lane);
      }
      if (chunk == 0) {
        for (int i = 0; i < n_remote; ++i) {
          uint8_t* row = dst[i] - L.payload_offset;
          const int dst_rank = s_dst_rank[warp][i];
          if (lane < k) {
            const bool mine = r.keep && r.owner_rank == dst_rank;
            int32_t* meta = reinterpret_cast<int32_t*>(row + sizeof(RowHeader));
            meta[lane] = mine ? r.local : -1;
            reinterpret_cast<float*>(meta + k)[lane] = mine ? r.weight : 0.f;
            meta[2 * k + lane] = mine ? slot : -1;
          }
          if (lane == 0 && kOverlap) {  // RowHeader's {scale_bytes, token}; RowMarks writes the rest
            *reinterpret_cast<int2*>(row + 8) = make_int2(static_cast<int32_t>(p.scale_bytes), t);
          } else if (lane == 0) {  // RowHeader {code, payload_bytes, scale_bytes, token}
            *reinterpret_cast<int4*>(row) = make_int4(static_cast<int32_t>(code), static_cast<int32_t>(p.payload_bytes),
                                                      static_cast<int32_t>(p.scale_bytes), t);
          }
        }
      }
      // own share: this rank's source comes first in its own batched layout, so slot = index.  Its
      // destinations go after the remote ones in dst, so that the piece is read (and quantised) once for
      // all of them; except a copied standard row's single own copy, which goes after the remote sends
      // (the link is the critical path; local stores mixed into the loop slowed it by 2 %), and a later
      // batched piece whose own slots (from the warp sending piece 0) are not there yet, which would
      // leave this warp idle waiting for them.
      const int64_t row = static_cast<int64_t>(L.rank) * L.max_tokens + t;
      int n_own = 0;
      bool own_after = kQuant < 0 && !L.batched;
      if (has_own && !own_after) {
        if (L.batched && chunk > 0) {
          uint32_t ready = 0;
          if (lane == 0) ready = ld_acquire_gpu_u32(p.self_ready + t) == code;
          own_after = !__shfl_sync(kFull, ready, 0);
          if (!own_after) slot = lane < k ? __ldcg(p.self_slot + static_cast<int64_t>(t) * k + lane) : -1;
        }
        if (!own_after)
          n_own = place_row(p, row, own ? r.local : -1, r.weight, slot, chunk == 0, dst + n_remote, dst_s + n_remote,
                            lane);
      } else if (!has_own && chunk == 0) {
        place_row(p, row, -1, 0.f, -1, true, dst + n_remote, dst_s + n_remote, lane);  // padding
      }
      const int64_t lo = chunk * p.chunk_bytes;
      const int64_t hi = min(p.payload_bytes, lo + p.chunk_bytes);
      send_payload<kQuant>(p, t, lo, hi, dst, dst_s, n_remote + n_own, lane, quant_stage);
      if (put_mode(L)) put_staged_piece<kQuant>(p, row_off, t, chunk, lo, hi, s_dst_rank[warp], n_remote);
      if (has_own && own_after) {
        if (L.batched && chunk > 0) {
          if (lane == 0) wait_u32(p.self_ready + t, code, deadline, err);
          __syncwarp();
          slot = lane < k ? __ldcg(p.self_slot + static_cast<int64_t>(t) * k + lane) : -1;
        }
        const int n = place_row(p, row, own ? r.local : -1, r.weight, slot, chunk == 0, dst, dst_s, lane);
        send_payload<kQuant>(p, t, lo, hi, dst, dst_s, n, lane, quant_stage);
      }
      if (kOverlap && marks.due(min(k, L.world - 1))) marks.mark(code, p.payload_bytes, lane);
    }

    if constexpr (kOverlap) {
      // the block's send warps arrive without waiting for the other blocks; the last block signals
      marks.mark(code, p.payload_bytes, lane);
      const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/false, deadline, err, send_warps * kWarpSize);
      stamp(L, kTraceDispatch, kTrSent);
      stamp(L, kTraceDispatch, kTrArrived);
      if (progress != nullptr && threadIdx.x == 0) {
        volatile ReceiveProgress* v = progress;
        v->sending = 0;
        uint64_t* slots = L.trace + (static_cast<int64_t>(kTraceDispatch) * gridDim.x + blockIdx.x) * kTraceSlots;
        slots[kTrRowsBySent] = static_cast<uint64_t>(v->rows);
        slots[kTrWaitedBySent] = v->waited_ns;
      }
      if (a.last) {
        close_work(work);
        // batched: the peers' per-expert counts as the other form publishes them (a peer that does not
        // receive while sending places rows by them); this rank's own counts are final only once every
        // block has received (below)
        for (int i = threadIdx.x; L.batched && i < L.world * nl; i += send_warps * kWarpSize) {
          const int peer = i / nl;
          if (peer == L.rank || !peer_active(L, peer)) continue;
          *(reinterpret_cast<int32_t*>(peer_ptr(p.c, peer) + L.counts_offset[parity]) + L.rank * nl + i % nl) =
              __ldcg(p.send_count + i);
          p.send_count[i] = 0;  // ready for the next call
        }
        if (L.batched) asm volatile("bar.sync 1, %0;" ::"r"(send_warps * kWarpSize) : "memory");
        signal_all(p.c, parity, (static_cast<uint64_t>(static_cast<uint32_t>(p.num_tokens)) << 32) | code,
                   send_warps * kWarpSize);
        stamp(L, kTraceDispatch, kTrSignalled);
        // every block read seq before arriving
        if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;
      }
    } else {
      // ---- publish per-expert counts, then signal: the last block to arrive does it for everyone
      if (put_mode(L)) put_quiet();
      stamp(L, kTraceDispatch, kTrSent, true);
      const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/true, deadline, err);
      stamp(L, kTraceDispatch, kTrArrived);
      if (a.last) {
        close_work(work);
        for (int i = threadIdx.x; L.batched && i < L.world * nl; i += blockDim.x) {
          const int peer = i / nl;
          if (!peer_active(L, peer)) continue;
          // [rank][e] of the peer's counts, or (put mode) [peer][e] of the staged counts
          int32_t* slot = put_mode(L) && peer != L.rank
                              ? reinterpret_cast<int32_t*>(own_at(p.c, L.stage_counts_offset)) + i
                              : reinterpret_cast<int32_t*>(peer_ptr(p.c, peer) + L.counts_offset[parity]) +
                                    L.rank * nl + i % nl;
          *slot = __ldcg(p.send_count + i);  // other blocks' atomics, at L2
          p.send_count[i] = 0;  // ready for the next call
        }
        __syncthreads();
        if (put_mode(L) && L.batched) {  // staged counts [peer][L] to [rank][L] of each peer's counts
          const int64_t bytes = static_cast<int64_t>(nl) * 4;
          for (int peer = warp; peer < L.world; peer += kWarps)
            if (peer != L.rank && peer_active(L, peer))
              put_warp(p.c, L.counts_offset[parity] + L.rank * bytes, bytes, L.stage_counts_offset + peer * bytes, peer);
          put_quiet();
          __syncthreads();
        }
        signal_all(p.c, parity, (static_cast<uint64_t>(static_cast<uint32_t>(p.num_tokens)) << 32) | code);
        stamp(L, kTraceDispatch, kTrSignalled);
      }
      if (!a.ok) return;
      if (blockIdx.x == 0 && threadIdx.x == 0)  // every block read seq before arriving
        *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;
      if (!(p.phases & kPhaseReceive)) return;
    }
  }
  if constexpr (kOverlap) {  // the receive warps from the start, the send warps once they arrived
    receive_while_sending(p, code, parity, data_half, &s_next_row, s_src_tokens, dst, dst_s, deadline, err, progress,
                          lane);
    if (L.batched) {  // every block has laid its rows out: the last one publishes the counts of the slots taken
      const Arrival a = grid_arrive(p.c.counters + kStateReceived, /*wait=*/false, deadline, err);
      if (a.last)
        for (int e = threadIdx.x; e < nl; e += blockDim.x) {
          int32_t* own = p.send_count + L.rank * nl + e;
          p.counts[e] = static_cast<int32_t>(min(static_cast<int64_t>(__ldcg(own)), p.capacity));
          *own = 0;  // ready for the next call
        }
    }
    __syncthreads();
    stamp(L, kTraceDispatch, kTrSource0 + 1);  // every source's rows laid out
    stamp(L, kTraceDispatch, kTrEnd);
    return;
  }

  // ---- receive: every source's flag first (peers signal once their sends are done, so the flags land
  // together), then one pass over all sources' rows: a decode-sized call pays one row's latency chain
  // for all sources instead of one per source.  Sources in the order own, rank+1, rank+2, ...: a
  // source's rows of expert e take the slots after every earlier source's (prefix of the published
  // counts).
  int* const s_tokens = s_prefix;               // [world] rows each source sent (-1: its flag never came)
  int* const s_count = s_prefix + L.world;      // [world][nl] rows each source sent to each local expert
  int* const s_base = s_count + L.world * nl;   // [world][nl] first slot of each source's rows of expert e
  uint8_t* const own_buf = peer_ptr(p.c, L.rank);
  const int32_t* const counts = reinterpret_cast<const int32_t*>(own_buf + L.counts_offset[parity]);
  for (int i = threadIdx.x; i < L.world; i += blockDim.x) {  // one thread per source: the waits overlap
    const int src = (L.rank + i) % L.world;
    const uint64_t* flag = reinterpret_cast<const uint64_t*>(own_buf + L.flags_offset) + parity * L.world + src;
    uint64_t v = peer_active(L, src) ? wait_flag(flag, code, src, deadline, err) : 0;  // a rank that left: no rows
    if (v != 0 && static_cast<int64_t>(v >> 32) > L.max_tokens) {
      if (blockIdx.x == 0) err.count(kStatusOverflow, 1);
      v = 0;
    }
    s_tokens[src] = v != 0 ? static_cast<int>(v >> 32) : -1;
    if (i < kTraceSources && L.trace != nullptr)
      L.trace[(static_cast<int64_t>(kTraceDispatch) * gridDim.x + blockIdx.x) * kTraceSlots + kTrSource0 + 2 * i] =
          global_timer_ns();
  }
  __syncthreads();
  // the counts of a source whose flag never came may be another call's: none
  for (int j = threadIdx.x; L.batched && j < L.world * nl; j += blockDim.x)
    s_count[j] = s_tokens[j / nl] >= 0 ? __ldcg(counts + j) : 0;
  __syncthreads();
  for (int e = threadIdx.x; L.batched && e < nl; e += blockDim.x) {
    int base = 0;
    for (int i = 0; i < L.world; ++i) {
      const int src = (L.rank + i) % L.world;
      s_base[src * nl + e] = base;
      base += s_count[src * nl + e];
    }
    if (blockIdx.x == 0) p.counts[e] = base;
  }
  __syncthreads();
  // this rank's rows below T were laid out while sending; the rest are padding
  for (int t = p.num_tokens + gwarp; t < L.max_tokens; t += nwarps)
    place_row(p, static_cast<int64_t>(L.rank) * L.max_tokens + t, -1, 0.f, -1, true, dst, dst_s, lane);
  // the peers' rows: [world - 1][max_tokens] in the order rank+1, rank+2, ...
  const int64_t peer_rows = static_cast<int64_t>(L.world - 1) * L.max_tokens;
  if (L.zero_copy && !L.batched) {
    // the payload stays where it landed: only the ids and weights of each row, one row per lane (a
    // warp per row would wait out a dependent header -> meta -> store chain for every row); row r goes
    // to warp r % nwarps, as 32 consecutive rows per warp left two thirds of the SMs idle at 4096 rows
    // on 24 SMs
    for (int64_t r = gwarp + static_cast<int64_t>(lane) * nwarps; r < peer_rows; r += static_cast<int64_t>(nwarps) * 32) {
      const int src = (L.rank + 1 + static_cast<int>(r / L.max_tokens)) % L.world;
      const int t = static_cast<int>(r % L.max_tokens);
      const int64_t row_index = static_cast<int64_t>(src) * L.max_tokens + t;
      receive_row_meta(p, own_buf + L.dispatch_offset[0] + row_index * L.row_stride, row_index, t < s_tokens[src],
                       code, src, err);
    }
  } else {
    for (int64_t item = gwarp; item < peer_rows * p.chunks; item += nwarps) {
      const int64_t r = item / p.chunks;
      const int chunk = static_cast<int>(item % p.chunks);
      const int src = (L.rank + 1 + static_cast<int>(r / L.max_tokens)) % L.world;
      const int t = static_cast<int>(r % L.max_tokens);
      const int64_t row_index = static_cast<int64_t>(src) * L.max_tokens + t;
      const uint8_t* row = own_buf + L.dispatch_offset[data_half] + row_index * L.row_stride;
      if (p.prefetch_pieces) {
        lay_out_prefetched(p, row, row_index, src, chunk, t < s_tokens[src], s_count, s_base, code, err, dst, dst_s,
                           lane);
        continue;
      }
      bool valid = false;
      if (t < s_tokens[src]) {
        const int4 h = ld_cg(reinterpret_cast<const int4*>(row));  // RowHeader
        valid = header_matches(p, static_cast<uint32_t>(h.x), h.y, h.z, code, src, lane == 0 && chunk == 0, err);
      }
      if (!valid && chunk > 0) continue;
      lay_out_piece(p, row, row_index, src, chunk, valid, s_count, s_base, dst, dst_s, lane);
    }
  }
  __syncthreads();
  stamp(L, kTraceDispatch, kTrSource0 + 1);  // every source's rows laid out
  stamp(L, kTraceDispatch, kTrEnd);
}

// Shared memory of the receive pass: [world] token counts, then [world][num_local] counts and slot bases.
// Up to this many bytes need no opt-in (with the kernel's static arrays, within the 48 KB default).
constexpr size_t kDefaultDynamicSmemBytes = 32 * 1024;
constexpr int kMaxDevices = 64;

size_t dispatch_smem_bytes(int world, int num_local) {
  return sizeof(int) * (static_cast<size_t>(world) + 2 * static_cast<size_t>(world) * static_cast<size_t>(num_local));
}

// Raise the kernel's dynamic shared memory limit to ``bytes`` on the current device, once: the limit
// is per function and device, and only ever raised, so launches of communicators of other sizes (from
// other host threads too) never see it lowered under them.
template <int kQuant, bool kIds64, bool kOverlap>
cudaError_t allow_dispatch_smem(size_t bytes) {
  static std::mutex mutex;
  static std::array<size_t, kMaxDevices> allowed{};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lock(mutex);
  if (bytes <= allowed[dev]) return cudaSuccess;
  e = cudaFuncSetAttribute(dispatch_kernel<kQuant, kIds64, kOverlap>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes));
  if (e == cudaSuccess) allowed[dev] = bytes;
  return e;
}

template <int kQuant, bool kIds64, bool kOverlap>
cudaError_t launch_dispatch_kernel(const DispatchParams& p, int num_blocks, cudaStream_t stream) {
  // the receive half's arrays, or (quantising, sending) the warps' stages, whichever is larger; a
  // launch that needs neither leaves the shared memory to L1
  const size_t recv = (p.phases & kPhaseReceive) ? dispatch_smem_bytes(p.c.lay.world, p.c.lay.num_local) : 0;
  const size_t stages = kQuant >= 0 && (p.phases & kPhaseSend) ? static_cast<size_t>(kWarps) * kQuantStageBytes : 0;
  // receiving while sending: [world] token counts, after the stages when quantising
  const size_t tokens = kOverlap ? stages + sizeof(int) * static_cast<size_t>(p.c.lay.world) : 0;
  const size_t smem = std::max({recv, stages, tokens});
  if (smem > kDefaultDynamicSmemBytes) {  // beyond the default: opt in (Limit.MAX_EXPERTS keeps it within the SM's)
    const cudaError_t e = allow_dispatch_smem<kQuant, kIds64, kOverlap>(smem);
    if (e != cudaSuccess) return e;
  }
  dispatch_kernel<kQuant, kIds64, kOverlap><<<dim3(num_blocks), dim3(kThreads), smem, stream>>>(p);
  return cudaGetLastError();
}

template <int kQuant, bool kIds64>
cudaError_t launch_dispatch_as(const DispatchParams& p, int num_blocks, cudaStream_t stream) {
  // the host receives while sending with copied rows or fp8 from bf16 only (ops.h): only those have that kernel
  if constexpr (kQuant < 0 || kQuant == kBf16) {
    if (p.receive_warps > 0) return launch_dispatch_kernel<kQuant, kIds64, true>(p, num_blocks, stream);
  }
  return launch_dispatch_kernel<kQuant, kIds64, false>(p, num_blocks, stream);
}

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, int quant_dtype, bool ids_int64, int num_blocks,
                            cudaStream_t stream) {
#define EP_DISPATCH(Q) \
  return ids_int64 ? launch_dispatch_as<Q, true>(p, num_blocks, stream) : launch_dispatch_as<Q, false>(p, num_blocks, stream)
  switch (quant_dtype) {
    case kBf16: EP_DISPATCH(kBf16);
    case kFp16: EP_DISPATCH(kFp16);
    case kFp32: EP_DISPATCH(kFp32);
    case kDispatchNvfp4 + kBf16: EP_DISPATCH(kDispatchNvfp4 + kBf16);
    case kDispatchNvfp4 + kFp16: EP_DISPATCH(kDispatchNvfp4 + kFp16);
    case kDispatchNvfp4 + kFp32: EP_DISPATCH(kDispatchNvfp4 + kFp32);
    default: EP_DISPATCH(-1);
  }
#undef EP_DISPATCH
}

}  // namespace EP_KERNELS
}  // namespace ep_comm
