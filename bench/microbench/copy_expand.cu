// Copy-engine-free row copies on a fixed number of SMs: does a TMA (cp.async.bulk) pipeline move
// more bytes per SM than the warp-wide 16-byte loads/stores the mnnvl kernels use?
//
// Shapes are the DeepSeek-V3 prefill case at EP2: 4096 received rows of 14336 bytes (bf16 x 7168),
//   expand  each row to 4 slots of a batched output (the batched dispatch's receive half),
//   copy    each row to 1 slot (the standard dispatch's receive half),
//   sum4    4 bf16 rows summed in fp32 to one bf16 row (the combine's read-bound half).
// Every variant runs on `blocks` blocks of 512 threads (one block per SM); the destination slots are
// a random permutation so stores scatter like the real layout.  Also copies to a peer GPU when there
// is one (`peer` rows: destination in GPU 1's memory, mapped with cudaDeviceEnablePeerAccess).
//
// Build and run (no torch needed):  nvcc -std=c++17 -O3 -arch=sm_90 copy_expand.cu -o ce && ./ce [rows] [blocks,...]
// (default block counts 24,32,64 and every SM; e.g. `./ce 4096 8,12,16,20,24` for how few SMs reach the link)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "check.cuh"

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kRowBytes = 14336;

// ---- warp-wide register copies (what the kernel backends do) --------------------------------------
template <int kUnroll>
__global__ void __launch_bounds__(kThreads, 1)
    warp_expand(const uint8_t* src, uint8_t* dst, const int* slots, int rows, int fan) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nw = gridDim.x * kWarps;
  const int n = kRowBytes / 16;
  for (int r = gw; r < rows; r += nw) {
    const int4* s = reinterpret_cast<const int4*>(src + static_cast<int64_t>(r) * kRowBytes);
    int i = lane;
    for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = __ldcg(s + i + u * 32);
      for (int d = 0; d < fan; ++d) {
        int4* o = reinterpret_cast<int4*>(dst + static_cast<int64_t>(slots[r * fan + d]) * kRowBytes);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) o[i + u * 32] = v[u];
      }
    }
    for (; i < n; i += 32) {
      const int4 v = __ldcg(s + i);
      for (int d = 0; d < fan; ++d)
        reinterpret_cast<int4*>(dst + static_cast<int64_t>(slots[r * fan + d]) * kRowBytes)[i] = v;
    }
  }
}

// ---- TMA bulk copies --------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)));
}
__device__ __forceinline__ void bulk_load(void* s, const void* g, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(s)),
               "l"(g), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(phase)
                 : "memory");
}
__device__ __forceinline__ void bulk_store(void* g, const void* s, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(g), "r"(smem_u32(s)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// One issuing lane per warp; a ring of kStages pieces of kPiece bytes per warp; loads run kStages-1
// pieces ahead of the stores.
template <int kStages, int kPiece>
__global__ void __launch_bounds__(kThreads, 1)
    tma_expand(const uint8_t* src, uint8_t* dst, const int* slots, int rows, int fan) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[kWarps][kStages];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane != 0) return;
  const int gw = blockIdx.x * kWarps + warp;
  const int nw = gridDim.x * kWarps;
  uint8_t* ring = smem + static_cast<size_t>(warp) * kStages * kPiece;
  for (int s = 0; s < kStages; ++s) mbar_init(&bars[warp][s]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  constexpr int kPer = kRowBytes / kPiece;
  const int my_rows = rows > gw ? (rows - gw + nw - 1) / nw : 0;
  const int pieces = my_rows * kPer;
  auto piece_src = [&](int i) {
    const int r = gw + (i / kPer) * nw;
    return src + static_cast<int64_t>(r) * kRowBytes + (i % kPer) * kPiece;
  };
  auto store_piece = [&](int j) {
    const int s = j % kStages;
    mbar_wait(&bars[warp][s], (j / kStages) & 1);
    const int r = gw + (j / kPer) * nw;
    for (int d = 0; d < fan; ++d)
      bulk_store(dst + static_cast<int64_t>(slots[r * fan + d]) * kRowBytes + (j % kPer) * kPiece,
                 ring + s * kPiece, kPiece);
    bulk_commit();
  };
  // kAhead loads in flight and up to two pieces' stores still reading their stages
  constexpr int kAhead = kStages - 2;
  static_assert(kAhead >= 1, "needs 3 stages or more");
  for (int i = 0; i < pieces; ++i) {
    if (i >= kStages) bulk_wait_read<1>();  // newest group is piece i - kStages + 1: piece i - kStages is done
    bulk_load(ring + (i % kStages) * kPiece, piece_src(i), kPiece, &bars[warp][i % kStages]);
    if (i >= kAhead) store_piece(i - kAhead);
  }
  for (int j = max(0, pieces - kAhead); j < pieces; ++j) store_piece(j);
  bulk_wait_all();
}

// ---- sum of 4 rows (combine) ------------------------------------------------------------------------
__device__ __forceinline__ void acc8(float* a, int4 v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(h[q]);
    a[2 * q] += f.x;
    a[2 * q + 1] += f.y;
  }
}
__device__ __forceinline__ int4 pack8(const float* a) {
  int4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(a[2 * q], a[2 * q + 1]);
  return o;
}

// registers: each lane loads 2 column vectors x 4 rows = 8 loads in flight
__global__ void __launch_bounds__(kThreads, 1) warp_sum4(const uint8_t* src, uint8_t* out, const int* slots, int rows) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nw = gridDim.x * kWarps;
  const int n = kRowBytes / 16;
  for (int r = gw; r < rows; r += nw) {
    const int4* s[4];
    for (int d = 0; d < 4; ++d) s[d] = reinterpret_cast<const int4*>(src + static_cast<int64_t>(slots[r * 4 + d]) * kRowBytes);
    int4* o = reinterpret_cast<int4*>(out + static_cast<int64_t>(r) * kRowBytes);
    for (int i = lane; i < n; i += 64) {
      int4 v[8];
      const bool two = i + 32 < n;
#pragma unroll
      for (int d = 0; d < 4; ++d) {
        v[2 * d] = __ldcg(s[d] + i);
        if (two) v[2 * d + 1] = __ldcg(s[d] + i + 32);
      }
      float a[8] = {0}, b[8] = {0};
#pragma unroll
      for (int d = 0; d < 4; ++d) {
        acc8(a, v[2 * d]);
        if (two) acc8(b, v[2 * d + 1]);
      }
      o[i] = pack8(a);
      if (two) o[i + 32] = pack8(b);
    }
  }
}

// TMA: lane 0 of each warp streams the 4 source rows' pieces into a ring; the warp sums from shared
// memory.  kStages pieces (of 4 rows each) in flight per warp.
template <int kStages, int kPiece>
__global__ void __launch_bounds__(kThreads, 1) tma_sum4(const uint8_t* src, uint8_t* out, const int* slots, int rows) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[kWarps][kStages];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gw = blockIdx.x * kWarps + warp;
  const int nw = gridDim.x * kWarps;
  uint8_t* ring = smem + static_cast<size_t>(warp) * kStages * 4 * kPiece;
  if (lane == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&bars[warp][s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  constexpr int kPer = kRowBytes / kPiece;
  const int my_rows = rows > gw ? (rows - gw + nw - 1) / nw : 0;
  const int pieces = my_rows * kPer;
  auto load = [&](int i) {
    const int r = gw + (i / kPer) * nw;
    uint8_t* st = ring + (i % kStages) * 4 * kPiece;
    uint64_t* bar = &bars[warp][i % kStages];
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(4 * kPiece) : "memory");
    for (int d = 0; d < 4; ++d)
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
              smem_u32(st + d * kPiece)),
          "l"(src + static_cast<int64_t>(slots[r * 4 + d]) * kRowBytes + (i % kPer) * kPiece), "r"(kPiece),
          "r"(smem_u32(bar))
          : "memory");
  };
  if (lane == 0)
    for (int i = 0; i < min(kStages, pieces); ++i) load(i);
  for (int j = 0; j < pieces; ++j) {
    const int s = j % kStages;
    mbar_wait(&bars[warp][s], (j / kStages) & 1);
    const int r = gw + (j / kPer) * nw;
    const int4* st = reinterpret_cast<const int4*>(ring + s * 4 * kPiece);
    int4* o = reinterpret_cast<int4*>(out + static_cast<int64_t>(r) * kRowBytes + (j % kPer) * kPiece);
    for (int i = lane; i < kPiece / 16; i += 32) {
      float a[8] = {0};
#pragma unroll
      for (int d = 0; d < 4; ++d) acc8(a, st[d * (kPiece / 16) + i]);
      o[i] = pack8(a);
    }
    __syncwarp();  // every lane is done with the stage before it is refilled
    if (lane == 0 && j + kStages < pieces) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      load(j + kStages);
    }
  }
}

// ---- driver -----------------------------------------------------------------------------------------

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 4096;
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, rows %d x %d B\n", prop.name, prop.multiProcessorCount, rows, kRowBytes);
  const int fan = 4;
  const int64_t slots_n = static_cast<int64_t>(rows) * fan;
  uint8_t *src, *dst, *dst_peer = nullptr, *out;
  int *slots_fan, *slots_one, *slots_sum;
  CK(cudaMalloc(&src, static_cast<int64_t>(rows) * kRowBytes));
  CK(cudaMalloc(&dst, slots_n * kRowBytes));
  CK(cudaMalloc(&out, static_cast<int64_t>(rows) * kRowBytes));
  CK(cudaMemset(src, 0x3c, static_cast<int64_t>(rows) * kRowBytes));
  CK(cudaMemset(dst, 0x3c, slots_n * kRowBytes));
  std::mt19937 g(1);
  std::vector<int> perm(slots_n);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), g);
  std::vector<int> one(rows);
  std::iota(one.begin(), one.end(), 0);
  std::shuffle(one.begin(), one.end(), g);
  CK(cudaMalloc(&slots_fan, slots_n * 4));
  CK(cudaMalloc(&slots_one, rows * 4));
  CK(cudaMalloc(&slots_sum, slots_n * 4));
  CK(cudaMemcpy(slots_fan, perm.data(), slots_n * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(slots_one, one.data(), rows * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(slots_sum, perm.data(), slots_n * 4, cudaMemcpyHostToDevice));
  if (ndev > 1) {
    int can = 0;
    CK(cudaDeviceCanAccessPeer(&can, 0, 1));
    if (can) {
      CK(cudaSetDevice(1));
      CK(cudaMalloc(&dst_peer, static_cast<int64_t>(rows) * kRowBytes));
      CK(cudaSetDevice(0));
      CK(cudaDeviceEnablePeerAccess(1, 0));
    }
  }
  constexpr int kS = 4, kP = 3584;  // 16 warps x 4 x 3.5 KB = 224 KB
  constexpr int kS2 = 2, kP2 = 1792;  // sum4: 16 warps x 2 x 4 x 1.75 KB = 224 KB
  const size_t smem1 = static_cast<size_t>(kWarps) * kS * kP, smem2 = static_cast<size_t>(kWarps) * kS2 * 4 * kP2;
  CK(cudaFuncSetAttribute(tma_expand<kS, kP>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem1)));
  CK(cudaFuncSetAttribute(tma_sum4<kS2, kP2>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem2)));

  // correctness of the TMA paths against the register paths (bytes compared on the host)
  {
    std::vector<uint8_t> h(static_cast<size_t>(rows) * kRowBytes);
    for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>((i * 2654435761u) >> 13) & 0x3f;
    CK(cudaMemcpy(src, h.data(), h.size(), cudaMemcpyHostToDevice));
    std::vector<uint8_t> a(slots_n * kRowBytes), b(slots_n * kRowBytes);
    warp_expand<4><<<24, kThreads>>>(src, dst, slots_fan, rows, fan);
    CK(cudaMemcpy(a.data(), dst, a.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemset(dst, 0, slots_n * kRowBytes));
    tma_expand<kS, kP><<<24, kThreads, smem1>>>(src, dst, slots_fan, rows, fan);
    CK(cudaGetLastError());
    CK(cudaMemcpy(b.data(), dst, b.size(), cudaMemcpyDeviceToHost));
    std::printf("check expand: %s\n", a == b ? "identical" : "DIFFERENT");
    std::vector<uint8_t> c(static_cast<size_t>(rows) * kRowBytes), d(c.size());
    warp_sum4<<<24, kThreads>>>(dst, out, slots_sum, rows);
    CK(cudaMemcpy(c.data(), out, c.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemset(out, 0, c.size()));
    tma_sum4<kS2, kP2><<<24, kThreads, smem2>>>(dst, out, slots_sum, rows);
    CK(cudaGetLastError());
    CK(cudaMemcpy(d.data(), out, d.size(), cudaMemcpyDeviceToHost));
    std::printf("check sum4: %s\n", c == d ? "identical" : "DIFFERENT");
  }

  const double row_mb = static_cast<double>(rows) * kRowBytes / 1e6;
  std::printf("%-26s %6s %10s %12s\n", "variant", "blocks", "p50 us", "GB/s moved");
  std::vector<int> block_counts{24, 32, 64, prop.multiProcessorCount};
  if (argc > 2) {  // a comma-separated list
    block_counts.clear();
    for (const char* c = argv[2]; *c != '\0';) {
      char* end = nullptr;
      const long b = std::strtol(c, &end, 10);
      if (end == c || b < 1 || b > prop.multiProcessorCount) {
        std::fprintf(stderr, "block counts: a comma-separated list of 1..%d\n", prop.multiProcessorCount);
        return 2;
      }
      block_counts.push_back(static_cast<int>(b));
      c = *end == ',' ? end + 1 : end;
    }
  }
  for (int blocks : block_counts) {
    auto report = [&](const char* name, std::pair<float, float> p50_min, double mb) {
      const float us = p50_min.first;
      std::printf("%-26s %6d %10.1f %12.0f\n", name, blocks, us, mb * 1e3 / us);
    };
    // expand: rows read once, written fan times
    report("expand regs u4", p50_min_us([&] { warp_expand<4><<<blocks, kThreads>>>(src, dst, slots_fan, rows, fan); }),
           row_mb * (1 + fan));
    report("expand regs u8", p50_min_us([&] { warp_expand<8><<<blocks, kThreads>>>(src, dst, slots_fan, rows, fan); }),
           row_mb * (1 + fan));
    report("expand tma", p50_min_us([&] { tma_expand<kS, kP><<<blocks, kThreads, smem1>>>(src, dst, slots_fan, rows, fan); }),
           row_mb * (1 + fan));
    report("copy regs u8", p50_min_us([&] { warp_expand<8><<<blocks, kThreads>>>(src, dst, slots_one, rows, 1); }),
           row_mb * 2);
    report("copy tma", p50_min_us([&] { tma_expand<kS, kP><<<blocks, kThreads, smem1>>>(src, dst, slots_one, rows, 1); }),
           row_mb * 2);
    report("sum4 regs", p50_min_us([&] { warp_sum4<<<blocks, kThreads>>>(dst, out, slots_sum, rows); }), row_mb * 5);
    report("sum4 tma", p50_min_us([&] { tma_sum4<kS2, kP2><<<blocks, kThreads, smem2>>>(dst, out, slots_sum, rows); }),
           row_mb * 5);
    if (dst_peer) {
      // to the peer: slots_one indexes rows < rows, so the peer buffer of `rows` rows suffices
      report("peer copy regs u4", p50_min_us([&] { warp_expand<4><<<blocks, kThreads>>>(src, dst_peer, slots_one, rows, 1); }),
             row_mb);
      report("peer copy tma",
             p50_min_us([&] { tma_expand<kS, kP><<<blocks, kThreads, smem1>>>(src, dst_peer, slots_one, rows, 1); }), row_mb);
    }
  }
  return 0;
}
