// The combine's row arithmetic, included by combine.cu: which expert rows a received row's partial sums,
// the float32 sums with their loads in flight and L2 prefetches, and the two pieces every combine form is
// made of: a partial sent to its owner, an own token's output summed from its partials.
#pragma once

#include <type_traits>

#include "one_sided/kernel_common.cuh"

namespace ep_comm {
namespace EP_KERNELS {
namespace {

// This rank's expert rows of received row ``r`` into src/w (one warp): batched, one per local expert
// with its weight; standard, the row itself (already weighted).  Returns how many (0: padding, which
// is never read whatever it holds).
// ``lid``: this lane's entry of the row's local ids (-1 past top_k), loaded by the caller.
template <typename Tin>
__device__ __forceinline__ int gather_expert_rows(const CombineParams& p, const Tin* eo, int64_t r, int lid,
                                                  const Tin** src, float* w, int lane) {
  const int k = p.c.lay.top_k;
  const int64_t H = p.c.lay.hidden;
  const unsigned mask = __ballot_sync(kFull, lid >= 0);
  if (mask == 0) return 0;
  int n = 1;
  if (p.c.lay.batched) {
    n = __popc(mask);
    if (lid >= 0) {
      const int j = __popc(mask & lanes_below(lane));
      src[j] = eo + static_cast<int64_t>(p.row_slot[r * k + lane]) * H;
      w[j] = p.row_w[r * k + lane];
    }
  } else if (lane == 0) {
    src[0] = eo + r * H;
    w[0] = 1.f;
  }
  __syncwarp();
  return n;
}

__device__ __forceinline__ int row_local_id(const CombineParams& p, int64_t r, int lane) {
  return lane < p.c.lay.top_k ? p.row_ids[r * p.c.lay.top_k + lane] : -1;
}

// dst[lo, hi) = sum_j w[j] * src[j] + sum_j part[j] in float32 (one warp); ``part`` are peers' partials
// (push) or peers' expert rows (pull), read around L1 (ld.cg) since they came over NVLink, as are the
// own rows (one stream of loads).  ``vec``: rows are 16-byte aligned (hidden % 8 == 0).
// Each lane keeps kSumRows x kSumCols raw 8-element loads in flight: combine is bound by how many
// bytes are in flight per SM (Little's law), not by arithmetic.
constexpr int kSumRows = 2;

// acc += the columns at c0 of w[j] * src[j] (j < n; weight 1 without w), then of part[j] (j < m), in that
// order.  Both lists go through one stream of loads (ld.cg), two rows at a time: summing the own rows
// before issuing the peers' loads waited out a local round before each remote one, every 2 KB of a row.
template <typename T, int kSumCols>
__device__ __forceinline__ void accumulate_rows(const T* const* src, const float* w, int n, const T* const* part,
                                                int m, int c0, int hi, float (&acc)[kSumCols][8]) {
  constexpr int kStep = 8 * kWarpSize;
  constexpr int kRows = sizeof(T) == 4 ? 1 : kSumRows;
  const int total = n + m;
  for (int j0 = 0; j0 < total; j0 += kRows) {
    Pack8<T> v[kRows][kSumCols];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int j = j0 + r;
      if (j >= total) break;
      const T* row = j < n ? src[j] : part[j - n];
#pragma unroll
      for (int c = 0; c < kSumCols; ++c)
        if (c0 + c * kStep < hi) v[r][c].load_cg(row + c0 + c * kStep);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int j = j0 + r;
      if (j >= total) break;
      const float scale = j < n && w != nullptr ? w[j] : 1.f;
#pragma unroll
      for (int c = 0; c < kSumCols; ++c)
        if (c0 + c * kStep < hi) v[r][c].fma_into(scale, acc[c]);
    }
  }
}

// The L2 is asked for the next column block's vectors of ``n`` rows while this block's loads are in
// flight, so that they are on chip when that block's rounds issue them (no registers held).
template <typename T, int kSumCols>
__device__ __forceinline__ void prefetch_columns(const T* const* rows, int n, int c0, int hi) {
  constexpr int kStep = 8 * kWarpSize;
  for (int j = 0; j < n; ++j)
#pragma unroll
    for (int c = 0; c < kSumCols; ++c)
      if (c0 + c * kStep < hi) prefetch_l2(rows[j] + c0 + c * kStep);
}

// Column blocks one warp iteration of sum_rows covers (fp32 accumulators and packs cost registers).
template <typename Tin, typename Tout>
__host__ __device__ constexpr int sum_cols() { return sizeof(Tin) == 4 || sizeof(Tout) == 4 ? 2 : 4; }

// kPrefetch (launch_combine decides, combine_prefetches): while this column block's loads are in
// flight the L2 is asked for the next one's.  ``prefetch_parts``: the partials are this rank's memory
// (pushed), not a peer's (pulled).
template <typename Tin, typename Tout, bool kPrefetch>
__device__ __forceinline__ void sum_rows(const Tin* const* src, const float* w, int n, const Tout* const* part, int m,
                                         Tout* dst, int lo, int hi, bool vec, bool prefetch_parts, int lane) {
  if (!vec) {
    for (int c = lo + lane; c < hi; c += kWarpSize) {
      float acc = 0.f;
      for (int j = 0; j < n; ++j) acc = fmaf(w[j], to_float<Tin>(src[j][c]), acc);
      for (int j = 0; j < m; ++j) acc += to_float<Tout>(part[j][c]);
      dst[c] = from_float<Tout>(acc);
    }
    return;
  }
  constexpr int kStep = 8 * kWarpSize;
  constexpr int kSumCols = sum_cols<Tin, Tout>();
  for (int c0 = lo + lane * 8; c0 < hi; c0 += kStep * kSumCols) {
    if constexpr (kPrefetch) {
      const int next = c0 + kStep * kSumCols;
      if (next < hi) {
        prefetch_columns<Tin, kSumCols>(src, n, next, hi);
        if (prefetch_parts) prefetch_columns<Tout, kSumCols>(part, m, next, hi);
      }
    }
    float acc[kSumCols][8];
#pragma unroll
    for (int c = 0; c < kSumCols; ++c)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[c][e] = 0.f;
    if constexpr (std::is_same<Tin, Tout>::value) {
      accumulate_rows<Tin, kSumCols>(src, w, n, part, m, c0, hi, acc);
    } else {  // two element types: one list after the other
      accumulate_rows<Tin, kSumCols>(src, w, n, nullptr, 0, c0, hi, acc);
      accumulate_rows<Tout, kSumCols>(nullptr, nullptr, 0, part, m, c0, hi, acc);
    }
#pragma unroll
    for (int c = 0; c < kSumCols; ++c)
      if (c0 + c * kStep < hi) Vec8<Tout>::store(dst + c0 + c * kStep, acc[c]);
  }
}

// Piece ``chunk`` of the partial of row (src, t) that this rank computes, into src's combine region
// (one warp).  Padding rows are never read.
template <typename Tin, typename Tout, bool kPrefetch>
__device__ __forceinline__ void send_partial_piece(const CombineParams& p, const Tin* eo, int src, int t, int chunk,
                                                   int parity, const Tin** src_rows, float* w, int lane) {
  const Layout& L = p.c.lay;
  const int lo = chunk * p.chunk_elems;
  const int hi = min(L.hidden, lo + p.chunk_elems);
  const int64_t r = static_cast<int64_t>(src) * L.max_tokens + t;
  const int n = gather_expert_rows<Tin>(p, eo, r, row_local_id(p, r, lane), src_rows, w, lane);
  if (n == 0) return;
  const int64_t off = L.combine_offset[parity] + (static_cast<int64_t>(L.rank) * L.max_tokens + t) * L.combine_stride;
  // put mode: summed into this rank's staging partial of (src, t), then put to the same place
  const int64_t staged = L.stage_combine_offset + (static_cast<int64_t>(src) * L.max_tokens + t) * L.combine_stride;
  Tout* dst = reinterpret_cast<Tout*>(put_mode(L) ? own_at(p.c, staged) : peer_ptr(p.c, src) + off);
  sum_rows<Tin, Tout, kPrefetch>(src_rows, w, n, nullptr, 0, dst, lo, hi, L.hidden % 8 == 0, false, lane);
  __syncwarp();
  if (put_mode(L)) {
    const int64_t b = static_cast<int64_t>(sizeof(Tout));
    put_warp(p.c, off + lo * b, (hi - lo) * b, staged + lo * b, src);
  }
}

// Piece ``chunk`` of own token t's output: this rank's own expert rows plus every peer's partial, read
// from ``region`` (this rank's combine region, where peers pushed them) or, with ``region`` null (pull),
// from each peer's own expert-output rows over NVLink.
template <typename Tin, typename Tout, bool kPrefetch>
__device__ __forceinline__ void sum_output_piece(const CombineParams& p, const Tin* eo, const uint8_t* region, int t,
                                                 int chunk, const Tin** src_rows, float* w, const Tout** parts,
                                                 int lane) {
  const Layout& L = p.c.lay;
  const int lo = chunk * p.chunk_elems;
  const int hi = min(L.hidden, lo + p.chunk_elems);
  const int64_t r = static_cast<int64_t>(L.rank) * L.max_tokens + t;
  // both of the token's small loads at once (the ids were loaded after the peers' rows were listed)
  const int d = lane < L.top_k ? p.dest[static_cast<int64_t>(t) * L.top_k + lane] : -1;
  const int lid = row_local_id(p, r, lane);
  const bool remote = d >= 0 && d != L.rank;
  const unsigned remote_mask = __ballot_sync(kFull, remote);
  const bool has_own = __ballot_sync(kFull, d == L.rank) != 0;
  if (remote) {
    // push: [d][t] of this rank's region; pull: [this rank][t] of d's expert rows (its combine half 0)
    const uint8_t* row = region != nullptr
                             ? region + (static_cast<int64_t>(d) * L.max_tokens + t) * L.combine_stride
                             : peer_ptr(p.c, d) + L.combine_offset[0] +
                                   (static_cast<int64_t>(L.rank) * L.max_tokens + t) * L.combine_stride;
    parts[__popc(remote_mask & lanes_below(lane))] = reinterpret_cast<const Tout*>(row);
  }
  __syncwarp();
  const int n = has_own ? gather_expert_rows<Tin>(p, eo, r, lid, src_rows, w, lane) : 0;
  sum_rows<Tin, Tout, kPrefetch>(src_rows, w, n, parts, __popc(remote_mask),
                                 static_cast<Tout*>(p.out) + static_cast<int64_t>(t) * L.hidden, lo, hi,
                                 L.hidden % 8 == 0, region != nullptr, lane);
  __syncwarp();
}

}  // namespace
}  // namespace EP_KERNELS
}  // namespace ep_comm
