// What the microbenchmarks share: the runtime-call check (print the call and CUDA's reason, then exit:
// standalone programs, nothing to recover), comma-separated option lists, launch timing, the
// quantising benchmarks' input rows, and a warp's local row copy.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// One row of ``bytes`` (16-byte aligned, a multiple of 16) from ``src`` to ``dst`` by one warp, 8 loads
// in flight per lane read around L1 (16-byte warp copies, as the kernels' receive side copies rows).
__device__ __forceinline__ void warp_copy_row(const uint8_t* src, uint8_t* dst, int bytes, int lane) {
  constexpr int kUnroll = 8;
  const int n = bytes / 16;
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* o = reinterpret_cast<int4*>(dst);
  for (int i = lane; i < n; i += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * 32 < n) v[u] = __ldcg(s + i + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * 32 < n) o[i + u * 32] = v[u];
  }
}

// "a,b,c" -> {"a", "b", "c"} (empty items dropped)
inline std::vector<std::string> comma_list(const std::string& s) {
  std::vector<std::string> v;
  for (size_t i = 0, j; i <= s.size(); i = j + 1) {
    j = std::min(s.find(',', i), s.size());
    if (j > i) v.push_back(s.substr(i, j - i));
  }
  return v;
}

// ``n`` bf16 values into device memory ``x``: uniform in [-0.5, 0.5) from a fixed linear congruential
// sequence (``seed``), scaled by 1, 2, ... 128 in turn per 128-channel block, so that the quantisers'
// blocks hold a spread of magnitudes
inline void fill_bf16_inputs(__nv_bfloat16* x, size_t n, uint32_t seed) {
  std::vector<__nv_bfloat16> h(n);
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const float u = static_cast<float>(seed >> 8) / 16777216.f - 0.5f;
    h[i] = __float2bfloat16(u * static_cast<float>(1 << ((i / 128) % 8)));
  }
  CK(cudaMemcpy(x, h.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
}

// p50 and minimum in µs of ``reps`` calls of ``launch`` (after 3 untimed), each timed alone between two
// events on the default stream
template <typename F>
std::pair<float, float> p50_min_us(F launch, int reps = 20) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) launch();
  CK(cudaDeviceSynchronize());
  std::vector<float> v;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0));
    launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    v.push_back(ms * 1000.f);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front()};
}
