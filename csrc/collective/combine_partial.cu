// Fused gather-weight-sum for the collective backends' batched combine (see combine_partial.h).
//
// Why a kernel: the torch path gathers every (row, expert) pair, local or not, and rewrites the
// float32 output k times; only about k / world of the pairs are local.  Here each warp owns a piece
// of one output row, reads only the local pairs' rows, and writes the float32 result once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "collective/combine_partial.h"
#include "common/device.cuh"
#include "common/protocol.h"

namespace ep_comm {
namespace collective {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
// vectors of V elements each lane keeps in flight per pair: 4 x 16 bytes, and two pairs are loaded
// together, so a lane has up to 8 independent loads outstanding (one would leave HBM idle)
constexpr int kUnroll = 4;

template <typename T, int V>
struct Lane;

template <typename T>
struct Lane<T, 8> {
  __device__ static void load(const T* p, float* f) { Vec8<T>::load(p, f); }
  __device__ static void store(float* p, const float* f) { Vec8<float>::store(p, f); }
};

template <typename T>
struct Lane<T, 1> {
  __device__ static void load(const T* p, float* f) { f[0] = to_float<T>(*p); }
  __device__ static void store(float* p, const float* f) { *p = f[0]; }
};

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) combine_partial_kernel(CombinePartialParams p, int64_t pieces_per_row) {
  constexpr int64_t kPiece = static_cast<int64_t>(kWarpSize) * V * kUnroll;  // elements per warp task
  const int lane = threadIdx.x % kWarpSize;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int64_t row = task / pieces_per_row;
  if (row >= p.rows) return;
  const int64_t first = (task % pieces_per_row) * kPiece + lane * V;
  const T* eo = static_cast<const T*>(p.expert_out);
  const int64_t* dest = p.dest + row * p.k;
  const float* weights = p.weights + row * p.k;

  float acc[kUnroll][V];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[u][i] = 0.f;

  // lanes read 32 pairs' slots at a time; the ballot names the local ones, so no lane ever touches
  // a slot outside [0, slots) (padding may hold NaN)
  for (int64_t base = 0; base < p.k; base += kWarpSize) {
    const int64_t j = base + lane;
    const int64_t d = j < p.k ? dest[j] : -1;
    const float w = j < p.k ? weights[j] : 0.f;
    unsigned local = __ballot_sync(0xffffffffu, d >= 0 && d < p.slots);
    while (local) {
      const int a = __ffs(local) - 1;
      local &= local - 1;
      const int b = local ? __ffs(local) - 1 : a;
      const bool two = local != 0;
      if (two) local &= local - 1;
      const int64_t da = __shfl_sync(0xffffffffu, d, a), db = __shfl_sync(0xffffffffu, d, b);
      const float wa = __shfl_sync(0xffffffffu, w, a), wb = __shfl_sync(0xffffffffu, w, b);
      const T* ra = eo + da * p.hidden;
      const T* rb = eo + db * p.hidden;
      float fa[kUnroll][V], fb[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = first + static_cast<int64_t>(u) * kWarpSize * V;
        if (e < p.hidden) {
          Lane<T, V>::load(ra + e, fa[u]);
          if (two) Lane<T, V>::load(rb + e, fb[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = first + static_cast<int64_t>(u) * kWarpSize * V;
        if (e < p.hidden) {
#pragma unroll
          for (int i = 0; i < V; ++i) acc[u][i] = fmaf(wa, fa[u][i], acc[u][i]);
          if (two) {
#pragma unroll
            for (int i = 0; i < V; ++i) acc[u][i] = fmaf(wb, fb[u][i], acc[u][i]);
          }
        }
      }
    }
  }

  float* out = p.out + (row / p.rows_per_chunk) * p.chunk_stride + (row % p.rows_per_chunk) * p.row_stride;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t e = first + static_cast<int64_t>(u) * kWarpSize * V;
    if (e < p.hidden) Lane<T, V>::store(out + e, acc[u]);
  }
}

template <typename T, int V>
cudaError_t launch_typed(const CombinePartialParams& p, cudaStream_t stream) {
  constexpr int64_t kPiece = static_cast<int64_t>(kWarpSize) * V * kUnroll;
  const int64_t pieces = (p.hidden + kPiece - 1) / kPiece;
  const int64_t blocks = (p.rows * pieces + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  combine_partial_kernel<T, V><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, pieces);
  return cudaGetLastError();
}

template <int V>
cudaError_t launch_vec(const CombinePartialParams& p, int in_dtype, cudaStream_t stream) {
  switch (in_dtype) {
    case kBf16: return launch_typed<__nv_bfloat16, V>(p, stream);
    case kFp16: return launch_typed<__half, V>(p, stream);
    case kFp32: return launch_typed<float, V>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_combine_partial(const CombinePartialParams& p, int in_dtype, bool vectorised, cudaStream_t stream) {
  if (p.rows <= 0 || p.hidden <= 0) return cudaSuccess;
  if (p.rows_per_chunk <= 0 || p.k < 0) return cudaErrorInvalidValue;
  if (vectorised && p.hidden % 8 != 0) return cudaErrorInvalidValue;
  return vectorised ? launch_vec<8>(p, in_dtype, stream) : launch_vec<1>(p, in_dtype, stream);
}

}  // namespace collective
}  // namespace ep_comm
