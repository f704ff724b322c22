// The quantisers' fast arithmetic (csrc/common/quantise.cuh) against the reference operations it stands
// for, over every float32 bit pattern:
//
//   e2m1   e2m1_pack8 (NVFP4 codes, eight at a time) against e2m1_code one value at a time: thread u
//          packs the values u ^ c_i (c_i a different constant per position, so each position runs
//          through every bit pattern as u does), NaNs replaced by zero (e2m1_pack8 serves only blocks
//          with no NaN)
//   fp8    the e4m3 byte of div_by_scale(x, s, 1/s) (fp8x4_e4m3_not_nan) against that of __fdiv_rn(x, s)
//          (fp8x4_e4m3), for 40 block scales s (the floor 1e-4 / 448, powers of two, and scales drawn
//          across the range up to 3e38: what a finite block amax gives) and every x a block of that
//          scale can hold (|x| <= 449 s)
//
// Prints the number of mismatches and the first few of each; exit code 1 on any.
//
// Build and run (1 GPU, no torch; csrc/common/protocol_table.h comes from the library's build):
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc bench/microbench/quant_arith.cu -o qa && ./qa
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "check.cuh"
#include "common/quantise.cuh"

struct Mismatch {
  unsigned long long count;
  uint32_t in[8], got[8], want[8];
};

__device__ void record(Mismatch* m, uint32_t in, uint32_t got, uint32_t want) {
  const unsigned long long j = atomicAdd(&m->count, 1ull);
  if (j < 8) {
    m->in[j] = in;
    m->got[j] = got;
    m->want[j] = want;
  }
}

__global__ void e2m1_kernel(Mismatch* m) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (1ull << 32);
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t u = static_cast<uint32_t>(i);
    float q[8];
    uint32_t want = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float v = __uint_as_float(u ^ (static_cast<uint32_t>(k) * 0x9E3779B9u));
      q[k] = v != v ? 0.f : v;
      want |= ep_comm::e2m1_code(q[k]) << (4 * k);
    }
    const uint32_t got = ep_comm::e2m1_pack8(q);
    if (got != want) record(m, u, got, want);
  }
}

constexpr int kScales = 40;

__global__ void fp8_kernel(const float* scales, Mismatch* m) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < (1ull << 32);
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float x = __uint_as_float(u);
    for (int k = 0; k < kScales; ++k) {
      const float s = scales[k];
      // the values a block of this scale holds: |x| <= amax, and s = amax / 448 rounded, so |x| / s
      // stays near 448 (NaN and inf make the scale non-finite)
      if (!(fabsf(x) <= fminf(449.0f * s, FLT_MAX))) continue;
      const uint32_t got = ep_comm::fp8x4_e4m3_not_nan(ep_comm::div_by_scale(x, s, __frcp_rn(s)), 0.f, 0.f, 0.f);
      const uint32_t want = ep_comm::fp8x4_e4m3(__fdiv_rn(x, s), 0.f, 0.f, 0.f);
      if (got != want) record(m, u, got, want);
    }
  }
}

template <typename F>
bool check(const char* what, F launch) {
  Mismatch* m = nullptr;
  CK(cudaMallocManaged(&m, sizeof(Mismatch)));
  m->count = 0;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  launch(m);
  CK(cudaEventRecord(e1));
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  std::printf("%s: %llu mismatches (%.1f ms)\n", what, m->count, ms);
  for (unsigned long long j = 0; j < m->count && j < 8; ++j)
    std::printf("  input 0x%08x: fast 0x%08x, reference 0x%08x\n", m->in[j], m->got[j], m->want[j]);
  const bool ok = m->count == 0;
  CK(cudaFree(m));
  return ok;
}

int main() {
  std::vector<float> h;
  h.push_back(1e-4f * (1.0f / 448.0f));  // the floor, as the kernel computes it
  for (int e = -20; e <= 120; e += 20) h.push_back(std::ldexp(1.0f, e));
  uint32_t r = 2463534242u;
  while (h.size() < kScales - 1) {  // log-uniform in [2^-23, 2^127]
    r ^= r << 13, r ^= r >> 17, r ^= r << 5;
    h.push_back(std::ldexp(1.0f + (r & 0xFFFFF) / 1048576.0f, static_cast<int>(r >> 24) % 150 - 23));
  }
  h.push_back(3.0e38f);
  float* scales = nullptr;
  CK(cudaMalloc(&scales, kScales * sizeof(float)));
  CK(cudaMemcpy(scales, h.data(), kScales * sizeof(float), cudaMemcpyHostToDevice));
  const bool e2m1 = check("e2m1_pack8 vs e2m1_code, 2^32 x 8 values",
                          [](Mismatch* m) { e2m1_kernel<<<132 * 8, 256>>>(m); });
  const bool fp8 = check("fp8 div_by_scale vs __fdiv_rn, 2^32 x 40 scales",
                         [&](Mismatch* m) { fp8_kernel<<<132 * 8, 256>>>(scales, m); });
  return e2m1 && fp8 ? 0 : 1;
}
