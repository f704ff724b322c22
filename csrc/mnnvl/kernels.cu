// mnnvl kernels: one launch per dispatch and one per combine (send, signal, wait, receive), so a
// call costs one kernel launch in eager mode and one graph node under CUDA graphs.
#include <type_traits>

#include "common/device.cuh"
#include "mnnvl/mnnvl.cuh"

namespace ep_comm {
namespace mnnvl {

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
  l.combine_stride = cfg[kCfgCombineStride];
  l.timeout_ns = static_cast<uint64_t>(cfg[kCfgTimeoutNs]);
  l.pending = reinterpret_cast<int32_t*>(static_cast<uintptr_t>(cfg[kCfgPendingPtr]));
  return l;
}

namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint8_t* peer_ptr(const Common& c, int r) {
  return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(c.peer_base[r]));
}

__device__ __forceinline__ uint64_t* flag_slot(const Common& c, int owner, int parity, int src) {
  return reinterpret_cast<uint64_t*>(peer_ptr(c, owner) + c.lay.flags_offset) + parity * c.lay.world + src;
}

__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }

// Signal every peer (and this rank) that this launch's sends are complete.  Called by the last
// block to arrive; each thread releases its own flag so the NVLink round trips overlap.
__device__ __forceinline__ void signal_all(const Common& c, int parity, uint64_t value) {
  for (int peer = threadIdx.x; peer < c.lay.world; peer += blockDim.x)
    st_release_sys(flag_slot(c, peer, parity, c.lay.rank), value);
}

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
  r.keep = valid && !dup;
  const int owner = r.keep ? __ldg(p.expert_owner + id) : -1;
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

// Lanes j < k hold local expert id ``lid`` (-1: none) and weight ``lw`` of output row ``row``.  Writes
// the row's ids and weights (and, batched, takes one slot per local expert) and leaves in ``dst`` /
// ``dst_s`` the places its payload and scales go: the standard row, or one batched slot per expert.
// Returns how many.  A row whose ids are all -1 is padding: ids written, nothing to copy.
__device__ __forceinline__ int place_row(const DispatchParams& p, int64_t row, int lid, float lw, uint8_t** dst,
                                         uint8_t** dst_s, int lane) {
  const int k = p.c.lay.top_k;
  if (lane < k) {
    p.row_ids[row * k + lane] = lid;
    p.row_w[row * k + lane] = lid >= 0 ? lw : 0.f;
  }
  const unsigned mask = __ballot_sync(kFull, lid >= 0);
  if (!p.c.lay.batched) {
    if (lane == 0) {
      dst[0] = static_cast<uint8_t*>(p.out_x) + row * p.payload_bytes;
      dst_s[0] = p.scale_bytes ? static_cast<uint8_t*>(p.out_scales) + row * p.scale_bytes : nullptr;
    }
    __syncwarp();
    return mask ? 1 : 0;
  }
  const int slot = lid >= 0 ? atomicAdd(p.counts + lid, 1) : -1;
  const int64_t flat = lid >= 0 ? static_cast<int64_t>(lid) * p.capacity + slot : -1;
  if (lane < k) p.row_slot[row * k + lane] = static_cast<int32_t>(flat);
  if (lid >= 0) {
    const int j = __popc(mask & lanes_below(lane));
    dst[j] = static_cast<uint8_t*>(p.out_x) + flat * p.payload_bytes;
    dst_s[j] = p.scale_bytes ? static_cast<uint8_t*>(p.out_scales) + flat * p.scale_bytes : nullptr;
  }
  __syncwarp();
  return __popc(mask);
}

// Copy (or quantise) token t of this rank's x, bytes [lo, hi) of its wire payload, to ``nd`` rows.
// ``dst`` point at the payload and ``dst_s`` at the scales of each row (scales written with lo == 0).
template <int kQuant>
__device__ __forceinline__ void send_payload(const DispatchParams& p, int t, int64_t lo, int64_t hi, uint8_t** dst,
                                             uint8_t** dst_s, int nd, int lane) {
  using QuantIn = typename std::conditional<kQuant == kFp16, __half,
                  typename std::conditional<kQuant == kFp32, float, __nv_bfloat16>::type>::type;
  if (nd == 0) return;
  if (kQuant >= 0) {
    // lo is a multiple of 256 channels (host side), so 128-channel scale blocks never straddle chunks
    if (lane < nd) {
      dst[lane] += lo;
      dst_s[lane] = reinterpret_cast<uint8_t*>(reinterpret_cast<float*>(dst_s[lane]) + lo / 128);
    }
    __syncwarp();
    const QuantIn* src = static_cast<const QuantIn*>(p.x) + static_cast<int64_t>(t) * p.c.lay.hidden + lo;
    warp_quant_fp8_multi<QuantIn>(src, static_cast<int>(hi - lo), dst, reinterpret_cast<float* const*>(dst_s), nd,
                                  lane);
  } else {
    if (lane < nd) dst[lane] += lo;
    __syncwarp();
    const uint8_t* src = static_cast<const uint8_t*>(p.x) + static_cast<int64_t>(t) * p.payload_bytes + lo;
    warp_copy_multi<false>(src, dst, nd, hi - lo, lane);
    if (lo == 0 && p.scale_bytes > 0) {
      const uint8_t* ssrc = static_cast<const uint8_t*>(p.x_scales) + static_cast<int64_t>(t) * p.scale_bytes;
      warp_copy_multi<false>(ssrc, dst_s, nd, p.scale_bytes, lane);
    }
  }
  __syncwarp();
}

template <int kQuant, bool kIds64>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const DispatchParams p) {
  const Layout& L = p.c.lay;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp;
  const int nwarps = gridDim.x * kWarps;
  const int k = L.top_k;
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  const ErrorSink err{p.c.status, L.pending, L.world};
  const uint64_t seq = *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq);
  const uint32_t code = make_code(seq, kOpDispatch);
  const int parity = static_cast<int>(seq & 1);

  __shared__ uint8_t* s_dst[kWarps][kMaxTopK];    // per warp: destination payloads
  __shared__ uint8_t* s_dst_s[kWarps][kMaxTopK];  // per warp: destination scales
  __shared__ int s_dst_rank[kWarps][kMaxTopK];
  uint8_t** dst = s_dst[warp];
  uint8_t** dst_s = s_dst_s[warp];

  // batched slots are taken with atomics on counts from the send phase on: zero them first
  unsigned long long* const zeroed = p.c.counters + kStateZeroed;
  if (L.batched && blockIdx.x == 0) {
    for (int e = threadIdx.x; e < L.num_local; e += blockDim.x) p.counts[e] = 0;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicExch(zeroed, static_cast<unsigned long long>(code));
    }
  }

  // ---- send: one copy of each token per remote destination rank, at [this rank][t] of that rank's
  // region; this rank's own share goes straight into the output layout (no second pass over it)
  const int64_t items = static_cast<int64_t>(p.num_tokens) * p.chunks;
  for (int64_t item = gwarp; item < items; item += nwarps) {
    const int t = static_cast<int>(item / p.chunks);
    const int chunk = static_cast<int>(item % p.chunks);
    const Route r = route_token<kIds64>(p, t, lane, chunk == 0, err);
    const bool leader = r.keep && ((r.leaders >> lane) & 1u);
    const bool remote = leader && r.owner_rank != L.rank;
    const unsigned remote_mask = __ballot_sync(kFull, remote);
    const int n_remote = __popc(remote_mask);
    if (chunk == 0) {  // the token's destination list, for combine
      if (leader) p.dest[static_cast<int64_t>(t) * k + __popc(r.leaders & lanes_below(lane))] = r.owner_rank;
      if (lane >= r.num_dest && lane < k) p.dest[static_cast<int64_t>(t) * k + lane] = -1;
    }
    if (remote) {
      const int i = __popc(remote_mask & lanes_below(lane));
      uint8_t* row = peer_ptr(p.c, r.owner_rank) + L.dispatch_offset[parity] +
                     (static_cast<int64_t>(L.rank) * L.max_tokens + t) * L.row_stride;
      dst[i] = row + L.payload_offset;
      dst_s[i] = row + L.scale_offset;
      s_dst_rank[warp][i] = r.owner_rank;
    }
    __syncwarp();
    if (chunk == 0) {
      for (int i = 0; i < n_remote; ++i) {
        uint8_t* row = dst[i] - L.payload_offset;
        const int dst_rank = s_dst_rank[warp][i];
        if (lane < k) {
          const bool mine = r.keep && r.owner_rank == dst_rank;
          reinterpret_cast<int32_t*>(row + sizeof(RowHeader))[lane] = mine ? r.local : -1;
          reinterpret_cast<float*>(row + sizeof(RowHeader) + 4 * k)[lane] = mine ? r.weight : 0.f;
        }
        if (lane == 0) {  // RowHeader {code, payload_bytes, scale_bytes, token}
          *reinterpret_cast<int4*>(row) = make_int4(static_cast<int32_t>(code), static_cast<int32_t>(p.payload_bytes),
                                                    static_cast<int32_t>(p.scale_bytes), t);
        }
      }
    }
    const int64_t lo = chunk * p.chunk_bytes;
    send_payload<kQuant>(p, t, lo, min(p.payload_bytes, lo + p.chunk_bytes), dst, dst_s, n_remote, lane);

    if (chunk == 0) {  // own share: the whole row, by the chunk-0 warp (chunks must agree on slots)
      if (L.batched && lane == 0) {
        uint32_t spins = 0;
        while (ld_acquire_gpu(zeroed) != static_cast<unsigned long long>(code)) {
          if ((++spins & 255u) == 0 && global_timer_ns() > deadline) {
            err.count(kStatusLocalStall, 1);
            break;
          }
        }
      }
      __syncwarp();
      const int lid = r.keep && r.owner_rank == L.rank ? r.local : -1;
      const int64_t row = static_cast<int64_t>(L.rank) * L.max_tokens + t;
      const int n = place_row(p, row, lid, r.weight, dst, dst_s, lane);
      send_payload<kQuant>(p, t, 0, p.payload_bytes, dst, dst_s, n, lane);
    }
  }

  // ---- signal: the last block to arrive releases every peer's flag for this source
  const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/true, deadline, err);
  if (a.last) signal_all(p.c, parity, (static_cast<uint64_t>(static_cast<uint32_t>(p.num_tokens)) << 32) | code);
  if (!a.ok) return;
  if (blockIdx.x == 0 && threadIdx.x == 0)  // every block read seq before arriving
    *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;

  // ---- receive: peers' rows [src][t] of our region into the output layout; own rows past T are padding
  __shared__ uint64_t s_flag;
  uint8_t* const own = peer_ptr(p.c, L.rank);
  for (int i = 0; i < L.world; ++i) {
    const int src = (L.rank + i) % L.world;
    int first = 0, src_tokens = p.num_tokens;
    if (src != L.rank) {
      if (threadIdx.x == 0) {
        const uint64_t* flag = reinterpret_cast<const uint64_t*>(own + L.flags_offset) + parity * L.world + src;
        uint64_t v = wait_flag(flag, code, src, deadline, err);
        if (v != 0 && static_cast<int64_t>(v >> 32) > L.max_tokens) {
          if (blockIdx.x == 0) err.count(kStatusOverflow, 1);
          v = (static_cast<uint64_t>(L.max_tokens) << 32) | static_cast<uint32_t>(v);
        }
        s_flag = v;
      }
      __syncthreads();
      src_tokens = static_cast<int>(s_flag >> 32);  // 0 when the source failed
    } else {
      first = p.num_tokens;  // rows below T were laid out while sending
    }
    const uint8_t* region = own + L.dispatch_offset[parity] + static_cast<int64_t>(src) * L.max_tokens * L.row_stride;
    for (int t = first + gwarp; t < L.max_tokens; t += nwarps) {
      const int64_t row_index = static_cast<int64_t>(src) * L.max_tokens + t;
      const uint8_t* row = region + t * L.row_stride;
      bool valid = false;
      if (src != L.rank && t < src_tokens) {
        const int4 h = ld_cg(reinterpret_cast<const int4*>(row));  // RowHeader
        valid = static_cast<uint32_t>(h.x) == code;
        if (valid && (h.y != p.payload_bytes || h.z != p.scale_bytes)) {
          if (lane == 0) {
            err.peer(src, kReasonFormat, static_cast<uint32_t>(h.y), static_cast<uint32_t>(p.payload_bytes));
            err.count(kStatusRowFormat, 1);
          }
          valid = false;
        }
      }
      int lid = -1;
      float lw = 0.f;
      if (valid && lane < k) {
        lid = __ldcg(reinterpret_cast<const int32_t*>(row + sizeof(RowHeader)) + lane);
        lw = __ldcg(reinterpret_cast<const float*>(row + sizeof(RowHeader) + 4 * k) + lane);
        if (lid < -1 || lid >= L.num_local) lid = -1;  // never trust an index from another process
      }
      const int n = place_row(p, row_index, lid, lw, dst, dst_s, lane);
      warp_copy_multi<true>(row + L.payload_offset, dst, n, p.payload_bytes, lane);
      if (p.scale_bytes > 0) warp_copy_multi<true>(row + L.scale_offset, dst_s, n, p.scale_bytes, lane);
      __syncwarp();
    }
    __syncthreads();  // s_flag is reused for the next source
  }
}

// ---- combine ------------------------------------------------------------------------------------------
template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineParams p) {
  const Layout& L = p.c.lay;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp;
  const int nwarps = gridDim.x * kWarps;
  const int k = L.top_k;
  const int H = L.hidden;
  const int vec_end = H % 8 == 0 ? H : 0;  // rows are 16-byte aligned only then; else element by element
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  const ErrorSink err{p.c.status, L.pending, L.world};
  const uint64_t seq = *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq);
  const uint32_t code = make_code(seq, kOpCombine);
  const int parity = static_cast<int>(seq & 1);

  __shared__ int64_t s_src_row[kWarps][kMaxTopK];
  __shared__ float s_w[kWarps][kMaxTopK];
  const Tin* eo = static_cast<const Tin*>(p.expert_out);

  // ---- send: one partial per (token, owner rank), to [this rank][t] of the owner's combine region
  const int64_t n_rows = static_cast<int64_t>(L.world) * L.max_tokens;
  for (int64_t r = gwarp; r < n_rows; r += nwarps) {
    const int src = static_cast<int>(r / L.max_tokens);
    const int t = static_cast<int>(r % L.max_tokens);
    const int lid = lane < k ? p.row_ids[r * k + lane] : -1;
    const unsigned mask = __ballot_sync(kFull, lid >= 0);
    if (mask == 0) continue;  // padding: never read, whatever it holds
    Tout* dst = reinterpret_cast<Tout*>(peer_ptr(p.c, src) + L.combine_offset[parity] +
                                        (static_cast<int64_t>(L.rank) * L.max_tokens + t) * L.combine_stride);
    if (!L.batched) {
      const Tin* s = eo + r * H;
      for (int c = lane * 8; c < vec_end; c += 8 * kWarpSize) {
        float f[8];
        Vec8<Tin>::load(s + c, f);
        Vec8<Tout>::store(dst + c, f);
      }
      for (int c = vec_end + lane; c < H; c += kWarpSize) dst[c] = from_float<Tout>(to_float<Tin>(s[c]));
    } else {
      const int n = __popc(mask);
      if (lid >= 0) {
        const int j = __popc(mask & lanes_below(lane));
        s_src_row[warp][j] = static_cast<int64_t>(p.row_slot[r * k + lane]) * H;
        s_w[warp][j] = p.row_w[r * k + lane];
      }
      __syncwarp();
      for (int c = lane * 8; c < vec_end; c += 8 * kWarpSize) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < n; ++j) {
          float f[8];
          Vec8<Tin>::load(eo + s_src_row[warp][j] + c, f);
          const float w = s_w[warp][j];
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] = fmaf(w, f[e], acc[e]);
        }
        Vec8<Tout>::store(dst + c, acc);
      }
      for (int c = vec_end + lane; c < H; c += kWarpSize) {
        float acc = 0.f;
        for (int j = 0; j < n; ++j) acc = fmaf(s_w[warp][j], to_float<Tin>(eo[s_src_row[warp][j] + c]), acc);
        dst[c] = from_float<Tout>(acc);
      }
      __syncwarp();
    }
  }

  const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/false, deadline, err);
  if (a.last) {
    signal_all(p.c, parity, code);
    if (threadIdx.x == 0)  // every block has arrived, so every block has read seq
      *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;
  }

  // ---- receive: wait for every rank's partials, then sum them per own token in float32
  __shared__ int s_ok;
  uint8_t* const own = peer_ptr(p.c, L.rank);
  if (threadIdx.x == 0) {
    int ok = 1;
    for (int i = 0; i < L.world; ++i) {
      const int src = (L.rank + i) % L.world;
      const uint64_t* flag = reinterpret_cast<const uint64_t*>(own + L.flags_offset) + parity * L.world + src;
      if (wait_flag(flag, code, src, deadline, err) == 0) ok = 0;
    }
    s_ok = ok;
  }
  __syncthreads();
  const uint8_t* region = own + L.combine_offset[parity];
  Tout* out = static_cast<Tout*>(p.out);
  for (int t = gwarp; t < p.num_tokens; t += nwarps) {
    const int d = lane < k ? p.dest[static_cast<int64_t>(t) * k + lane] : -1;
    const unsigned mask = __ballot_sync(kFull, d >= 0);
    const int n = __popc(mask);
    if (d >= 0) {
      s_src_row[warp][__popc(mask & lanes_below(lane))] =
          (static_cast<int64_t>(d) * L.max_tokens + t) * L.combine_stride;
    }
    __syncwarp();
    for (int c = lane * 8; c < vec_end; c += 8 * kWarpSize) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j = 0; j < n; ++j) {
        float f[8];
        Vec8<Tout>::load_cg(reinterpret_cast<const Tout*>(region + s_src_row[warp][j]) + c, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += f[e];
      }
      Vec8<Tout>::store(out + static_cast<int64_t>(t) * H + c, acc);
    }
    for (int c = vec_end + lane; c < H; c += kWarpSize) {
      float acc = 0.f;
      for (int j = 0; j < n; ++j)
        acc += to_float<Tout>(reinterpret_cast<const Tout*>(region + s_src_row[warp][j])[c]);
      out[static_cast<int64_t>(t) * H + c] = from_float<Tout>(acc);
    }
    __syncwarp();
  }
}

__global__ void abort_kernel(const Common c) {
  const uint64_t seq = *reinterpret_cast<volatile unsigned long long*>(c.counters + kStateSeq);
  signal_all(c, static_cast<int>(seq & 1), make_code(seq, kOpAbort));
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(c.counters + kStateSeq) = seq + 1;
}

template <bool kIds64>
__global__ void check_ids_kernel(const void* ids, int64_t n, int num_experts, int32_t* flag) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const long long v = kIds64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
    if (v < -1 || v >= num_experts) st_volatile_sys_i32(flag, 1);
  }
}

}  // namespace

cudaError_t launch_dispatch(const DispatchParams& p, int quant_dtype, bool ids_int64, int num_blocks,
                            cudaStream_t stream) {
  const dim3 grid(num_blocks), block(kThreads);
#define EP_DISPATCH(Q)                                                                          \
  do {                                                                                          \
    if (ids_int64) dispatch_kernel<Q, true><<<grid, block, 0, stream>>>(p);                     \
    else dispatch_kernel<Q, false><<<grid, block, 0, stream>>>(p);                              \
  } while (0)
  switch (quant_dtype) {
    case kBf16: EP_DISPATCH(kBf16); break;
    case kFp16: EP_DISPATCH(kFp16); break;
    case kFp32: EP_DISPATCH(kFp32); break;
    default: EP_DISPATCH(-1); break;
  }
#undef EP_DISPATCH
  return cudaGetLastError();
}

cudaError_t launch_combine(const CombineParams& p, int in_dtype, int out_dtype, int num_blocks,
                           cudaStream_t stream) {
  const dim3 grid(num_blocks), block(kThreads);
#define EP_COMBINE_OUT(Tin)                                                                     \
  do {                                                                                          \
    switch (out_dtype) {                                                                        \
      case kBf16: combine_kernel<Tin, __nv_bfloat16><<<grid, block, 0, stream>>>(p); break;     \
      case kFp16: combine_kernel<Tin, __half><<<grid, block, 0, stream>>>(p); break;            \
      default: combine_kernel<Tin, float><<<grid, block, 0, stream>>>(p); break;                \
    }                                                                                           \
  } while (0)
  switch (in_dtype) {
    case kBf16: EP_COMBINE_OUT(__nv_bfloat16); break;
    case kFp16: EP_COMBINE_OUT(__half); break;
    default: EP_COMBINE_OUT(float); break;
  }
#undef EP_COMBINE_OUT
  return cudaGetLastError();
}

cudaError_t launch_abort(const Common& c, cudaStream_t stream) {
  abort_kernel<<<1, 128, 0, stream>>>(c);
  return cudaGetLastError();
}

cudaError_t launch_check_ids(const void* ids, bool ids_int64, int64_t n, int num_experts, int32_t* flag,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 1024));
  if (ids_int64) check_ids_kernel<true><<<blocks, threads, 0, stream>>>(ids, n, num_experts, flag);
  else check_ids_kernel<false><<<blocks, threads, 0, stream>>>(ids, n, num_experts, flag);
  return cudaGetLastError();
}

}  // namespace mnnvl
}  // namespace ep_comm
