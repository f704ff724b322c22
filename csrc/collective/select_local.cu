// Layout selection of the collective backends (see select_local.h).
#include <climits>
#include <cstdint>

#include "collective/select_local.h"
#include "common/device.cuh"

namespace ep_comm {
namespace collective {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;

// One thread per gathered row: k is small (top-k), so the repeat search is a short loop.
__global__ void __launch_bounds__(kThreads) select_rows_kernel(SelectLocalParams p) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (r >= p.rows) return;
  const int64_t chunk = r / p.rows_per_chunk, within = r % p.rows_per_chunk;
  const int32_t* ids = p.ids + chunk * p.ids_chunk_stride + within * p.ids_row_stride;
  const float* w = p.weights + chunk * p.w_chunk_stride + within * p.w_row_stride;
  const int32_t first = p.rank * p.num_local;
  const int64_t trash = static_cast<int64_t>(p.num_local) * p.capacity + r;
  bool any = false;
  for (int64_t j = 0; j < p.k; ++j) {
    const int32_t id = ids[j];
    int32_t lid = -1;
    float sum = 0.f;
    if (id >= first && id - first < p.num_local) {
      bool repeat = false;
      for (int64_t i = 0; i < j && !repeat; ++i) repeat = ids[i] == id;
      if (!repeat) {  // the expert's first slot carries the row's weights for it, summed in slot order
        lid = id - first;
        for (int64_t i = j; i < p.k; ++i) sum += ids[i] == id ? w[i] : 0.f;
      }
    }
    p.local_ids[r * p.k + j] = lid;
    p.local_w[r * p.k + j] = sum;
    if (p.dest != nullptr && lid < 0) p.dest[r * p.k + j] = trash;  // local pairs: assign_slots_kernel
    any = any || lid >= 0;
  }
  p.row_valid[r] = any;
}

// One block per local expert: a block-wide running count over the pairs in row-major order gives each
// of the expert's pairs its slot (the same order the torch path's cumulative sum gives).
__global__ void __launch_bounds__(kThreads) assign_slots_kernel(SelectLocalParams p) {
  __shared__ int32_t warp_counts[kWarps];
  __shared__ int64_t running;
  const int32_t e = static_cast<int32_t>(blockIdx.x);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  const int64_t pairs = p.rows * p.k;
  for (int64_t base = 0; base < pairs; base += kThreads) {  // uniform trip count: every warp ballots
    const int64_t q = base + threadIdx.x;
    const bool mine = q < pairs && p.local_ids[q] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int64_t offset = running;
    int64_t total = 0;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      offset += i < warp ? warp_counts[i] : 0;
      total += warp_counts[i];
    }
    if (mine) {
      const int64_t slot = offset + __popc(ballot & ((1u << lane) - 1u));
      p.dest[q] = slot < p.capacity ? e * p.capacity + slot
                                    : static_cast<int64_t>(p.num_local) * p.capacity + q / p.k;
    }
    __syncthreads();  // every thread has read running and warp_counts
    if (threadIdx.x == 0) running += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) p.counts[e] = static_cast<int32_t>(running < p.capacity ? running : p.capacity);
}

// One warp per (row, piece of the row): the piece is loaded once and stored into every local slot.
constexpr int kPerLane = 4;

template <typename V>
__global__ void __launch_bounds__(kThreads) scatter_rows_kernel(ScatterRowsParams p, int64_t pieces_per_row) {
  const int64_t elems = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  const int64_t row = task / pieces_per_row;
  if (row >= p.rows) return;
  const int64_t first = (task % pieces_per_row) * kWarpSize * kPerLane + threadIdx.x % kWarpSize;
  const V* src = reinterpret_cast<const V*>(p.src + row * p.src_stride);
  V v[kPerLane];
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    const int64_t e = first + static_cast<int64_t>(u) * kWarpSize;
    if (e < elems) v[u] = src[e];
  }
  const int64_t* dest = p.dest + row * p.k;
  for (int64_t j = 0; j < p.k; ++j) {
    const int64_t d = dest[j];
    if (d < 0 || d >= p.slots) continue;
    V* out = reinterpret_cast<V*>(p.out + d * p.row_bytes);
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int64_t e = first + static_cast<int64_t>(u) * kWarpSize;
      if (e < elems) out[e] = v[u];
    }
  }
}

template <typename V>
cudaError_t launch_scatter_typed(const ScatterRowsParams& p, cudaStream_t stream) {
  const int64_t elems = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t per_warp = static_cast<int64_t>(kWarpSize) * kPerLane;
  const int64_t pieces = (elems + per_warp - 1) / per_warp;
  const int64_t blocks = (p.rows * pieces + kWarps - 1) / kWarps;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  scatter_rows_kernel<V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, pieces);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_select_local(const SelectLocalParams& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.k <= 0) {
    if (p.counts != nullptr && p.num_local > 0)
      return cudaMemsetAsync(p.counts, 0, sizeof(int32_t) * static_cast<size_t>(p.num_local), stream);
    return cudaSuccess;
  }
  if (p.rows_per_chunk <= 0 || p.num_local <= 0 || (p.dest == nullptr) != (p.counts == nullptr))
    return cudaErrorInvalidValue;
  const int64_t blocks = (p.rows + kThreads - 1) / kThreads;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  select_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.dest == nullptr) return err;
  assign_slots_kernel<<<static_cast<unsigned>(p.num_local), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_scatter_rows(const ScatterRowsParams& p, bool vectorised, cudaStream_t stream) {
  if (p.rows <= 0 || p.row_bytes <= 0 || p.k <= 0) return cudaSuccess;
  if (vectorised && (p.row_bytes % 16 != 0 || p.src_stride % 16 != 0)) return cudaErrorInvalidValue;
  return vectorised ? launch_scatter_typed<int4>(p, stream) : launch_scatter_typed<uint8_t>(p, stream);
}

}  // namespace collective
}  // namespace ep_comm
