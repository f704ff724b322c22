// The NVFP4 quantiser's fast e2m1 packing (csrc/common/quantise.cuh: e2m1_pack8) against its reference
// conversion (e2m1_code, one value at a time), for every float32 that is not NaN in each of the eight
// positions: thread u packs the values u ^ c_i (c_i a different constant per position, so each position
// runs through every bit pattern as u does), NaNs replaced by zero (e2m1_pack8 is used only for blocks
// with no NaN).  Prints the number of mismatches and the first few; exit code 1 on any.
//
// Build and run (1 GPU, no torch; csrc/common/protocol_table.h comes from the library's build):
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc bench/microbench/e2m1_pack.cu -o ep && ./ep
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "check.cuh"
#include "common/quantise.cuh"

struct Mismatch {
  unsigned long long count;
  uint32_t u[8], got[8], want[8];
};

__global__ void compare_kernel(Mismatch* m) {
  const uint64_t n = 1ull << 32;
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
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
    if (got != want) {
      const unsigned long long j = atomicAdd(&m->count, 1ull);
      if (j < 8) {
        m->u[j] = u;
        m->got[j] = got;
        m->want[j] = want;
      }
    }
  }
}

int main() {
  Mismatch* m = nullptr;
  CK(cudaMallocManaged(&m, sizeof(Mismatch)));
  m->count = 0;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  compare_kernel<<<132 * 8, 256>>>(m);
  CK(cudaEventRecord(e1));
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  std::printf("e2m1_pack8 vs e2m1_code: 2^32 x 8 values, %llu mismatches (%.1f ms)\n", m->count, ms);
  for (unsigned long long j = 0; j < m->count && j < 8; ++j)
    std::printf("  u 0x%08x: packed 0x%08x, reference 0x%08x\n", m->u[j], m->got[j], m->want[j]);
  return m->count == 0 ? 0 : 1;
}
