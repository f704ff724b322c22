// Pulling combine over NVLink: how fast can GPU 0 read a peer GPU's rows, by read method and by the
// kind of peer mapping?
//
// The shape is the kernel backends' pulling combine at EP2, DeepSeek-V3 prefill: for 4096 tokens,
// out[t] = w0[t] * own[t] + w1[t] * peer[t], rows bf16 x 7168 (14336 B), fp32 sums, bf16 out.  own and
// out are in GPU 0 memory; peer rows are physically on GPU 1 and read by a kernel on GPU 0.  It sets
// register loads against TMA bulk copies and cp.async rings into shared memory (more bytes in flight
// per SM), over the three ways the peer rows can be mapped (cudaMalloc + peer access, cuMem VMM, cuMem
// VMM re-imported from a POSIX fd as another process would), so that the library kernel's time can be
// compared with what the link gives.
//
// Variants (one block of 512 threads per SM, a warp per token row, tokens strided over global warps):
//   regs4 / regs8  each lane loads U int4 of the own row and U of the peer row (peer: ld.global.cg), sums, stores
//   tma            lane 0 streams the peer row's segments (S stages x B bytes per warp) with
//                  cp.async.bulk + mbarrier, running ahead across rows; own row from global
//   tma-both       the same with the own row's segment also bulk-copied into the stage
//   cpasync        cp.async.cg 16 B per lane into a 3-stage ring of 2 KB per row
// Every variant's output is compared with regs4's (itself checked bit for bit against the host).
// Prints `kind variant S B blocks p50_us min_us GBps ndiff result` lines (GBps = NVLink bytes read /
// p50), then `done`; exit code 1 on any FAIL.
//
// Build and run (2 GPUs, no torch):
//   nvcc -std=c++17 -O3 -arch=sm_90 -lcuda bench/microbench/pull_peer.cu -o pp && ./pp
//   options: --blocks 24,32  --variants regs4,tma  --kinds vmm,malloc  --tma 4x3584,8x1792  --tma-both 2x3584
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "check.cuh"
// driver calls: returns false (after printing) so that optional mappings can be skipped
static bool cu_ok(CUresult r, const char* what, int line) {
  if (r == CUDA_SUCCESS) return true;
  const char *name = "?", *text = "?";
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  std::fprintf(stderr, "%s:%d %s: %s (%s)\n", __FILE__, line, what, name, text);
  return false;
}
#define CU(x) cu_ok((x), #x, __LINE__)

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kHidden = 7168;
constexpr int kRowBytes = kHidden * 2;
constexpr int kRowVecs = kRowBytes / 16;  // 896 int4 per row
constexpr int kTokens = 4096;

struct Args {
  const uint8_t* own;
  const uint8_t* peer;
  const float* w0;
  const float* w1;
  uint8_t* out;
  int tokens;
};

// fp32 math in one fixed order (mul, then fma) in every variant and on the host, so outputs are bitwise equal
__device__ __forceinline__ int4 mix8(int4 o, int4 p, float w0, float w1) {
  const __nv_bfloat162* ho = reinterpret_cast<const __nv_bfloat162*>(&o);
  const __nv_bfloat162* hp = reinterpret_cast<const __nv_bfloat162*>(&p);
  int4 r;
  __nv_bfloat162* hr = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 a = __bfloat1622float2(ho[q]), b = __bfloat1622float2(hp[q]);
    hr[q] = __floats2bfloat162_rn(__fmaf_rn(w1, b.x, __fmul_rn(w0, a.x)), __fmaf_rn(w1, b.y, __fmul_rn(w0, a.y)));
  }
  return r;
}
__device__ __forceinline__ const int4* row(const uint8_t* base, int t) {
  return reinterpret_cast<const int4*>(base + static_cast<int64_t>(t) * kRowBytes);
}

// ---- registers: U int4 of each row in flight per lane (the library's kernel is U = 4) ------------------
template <int U>
__global__ void __launch_bounds__(kThreads, 1) regs_kernel(Args a) {
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int nw = gridDim.x * kWarps;
  for (int t = gw; t < a.tokens; t += nw) {
    const float w0 = a.w0[t], w1 = a.w1[t];
    const int4 *o = row(a.own, t), *p = row(a.peer, t);
    int4* d = const_cast<int4*>(row(a.out, t));
    for (int i = lane; i < kRowVecs; i += 32 * U) {
      int4 vo[U], vp[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * 32 < kRowVecs) {
          vo[u] = o[i + u * 32];  // own rows: plain loads, like Pack8::load
          vp[u] = __ldcg(p + i + u * 32);
        }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (i + u * 32 < kRowVecs) d[i + u * 32] = mix8(vo[u], vp[u], w0, w1);
    }
  }
}

// ---- TMA bulk copies --------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t sa(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void bar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(b)), "r"(bytes) : "memory");
}
// traps after 2 s instead of hanging the benchmark if a bulk copy never completes
__device__ __forceinline__ void bar_wait(uint64_t* b, uint32_t parity) {
  uint32_t ok = 0;
  uint64_t t0 = 0, now;
  for (;;) {
    asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                 : "=r"(ok)
                 : "r"(sa(b)), "r"(parity)
                 : "memory");
    if (ok) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (t0 == 0) t0 = now;
    if (now - t0 > 2000000000ull) {
      printf("block %d thread %d: mbarrier wait timed out\n", blockIdx.x, threadIdx.x);
      __trap();
    }
  }
}
// a non-cluster launch is a cluster of one, so the CTA's own shared::cta address is a valid shared::cluster one
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* b) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa(dst)),
               "l"(src), "r"(bytes), "r"(sa(b))
               : "memory");
}

// dynamic shared memory: [16 x S mbarriers, padded to 128 B][16 per-warp rings of S stages]
__host__ __device__ constexpr size_t bars_bytes(int S) { return (static_cast<size_t>(kWarps) * S * 8 + 127) / 128 * 128; }
constexpr size_t tma_smem(int S, int B, bool both) { return bars_bytes(S) + static_cast<size_t>(kWarps) * S * B * (both ? 2 : 1); }

// Segment k of a warp's work is segment k % kSegs of its (k / kSegs)-th token; lane 0 keeps S segments
// in flight and refills a stage as soon as the warp is done with it, so a warp's next token is already
// streaming while it finishes the current one.
template <int B, bool kBoth>
__global__ void __launch_bounds__(kThreads, 1) tma_kernel(Args a, int S) {
  static_assert(kRowBytes % B == 0 && B % 16 == 0, "segments must tile the row in 16-byte units");
  constexpr int kSegs = kRowBytes / B;
  constexpr int kSegVecs = B / 16;
  constexpr int kPerLane = (kSegVecs + 31) / 32;
  constexpr int kStage = kBoth ? 2 * B : B;
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gw = blockIdx.x * kWarps + warp;
  const int nw = gridDim.x * kWarps;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * S;
  uint8_t* ring = smem + bars_bytes(S) + static_cast<size_t>(warp) * S * kStage;
  const int segs = (a.tokens > gw ? (a.tokens - gw + nw - 1) / nw : 0) * kSegs;
  if (lane == 0) {
    for (int s = 0; s < S; ++s) bar_init(bars + s);
    // barrier init visible to the async proxy (the bulk copies' complete_tx) before first use
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncwarp();
  auto issue = [&](int k) {
    const int t = gw + (k / kSegs) * nw;
    const int64_t off = static_cast<int64_t>(t) * kRowBytes + (k % kSegs) * B;
    uint8_t* st = ring + (k % S) * kStage;
    uint64_t* b = bars + k % S;
    bar_expect(b, kStage);
    bulk_g2s(st, a.peer + off, B, b);
    if (kBoth) bulk_g2s(st + B, a.own + off, B, b);
  };
  if (lane == 0)
    for (int k = 0; k < min(S, segs); ++k) issue(k);
  for (int j = 0; j < segs; ++j) {
    const int t = gw + (j / kSegs) * nw;
    const int64_t off = static_cast<int64_t>(t) * kRowBytes + (j % kSegs) * B;
    const float w0 = a.w0[t], w1 = a.w1[t];
    int4 vo[kPerLane];
    if (!kBoth) {  // own loads go out before the wait, so their latency hides behind the peer segment's
      const int4* o = reinterpret_cast<const int4*>(a.own + off);
#pragma unroll
      for (int u = 0; u < kPerLane; ++u)
        if (lane + u * 32 < kSegVecs) vo[u] = o[lane + u * 32];
    }
    const int s = j % S;
    bar_wait(bars + s, (j / S) & 1);
    const int4* st = reinterpret_cast<const int4*>(ring + s * kStage);
    int4* d = reinterpret_cast<int4*>(a.out + off);
#pragma unroll
    for (int u = 0; u < kPerLane; ++u)
      if (lane + u * 32 < kSegVecs) {
        if (kBoth) vo[u] = st[kSegVecs + lane + u * 32];
        d[lane + u * 32] = mix8(vo[u], st[lane + u * 32], w0, w1);
      }
    __syncwarp();  // every lane has read the stage before lane 0 refills it
    if (lane == 0 && j + S < segs) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic reads before async-proxy writes
      issue(j + S);
    }
  }
}

// ---- cp.async.cg: 3 stages x (2 KB own + 2 KB peer) per warp; a lane only reads back what it copied -------
constexpr int kCpChunk = 2048, kCpStages = 3, kCpChunks = kRowBytes / kCpChunk;
constexpr size_t kCpSmem = static_cast<size_t>(kWarps) * kCpStages * 2 * kCpChunk;

__global__ void __launch_bounds__(kThreads, 1) cpasync_kernel(Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gw = blockIdx.x * kWarps + warp;
  const int nw = gridDim.x * kWarps;
  uint8_t* ring = smem + static_cast<size_t>(warp) * kCpStages * 2 * kCpChunk;
  const int n = (a.tokens > gw ? (a.tokens - gw + nw - 1) / nw : 0) * kCpChunks;
  auto issue = [&](int k) {  // always commits a group (maybe empty) so wait_group counts stay fixed
    if (k < n) {
      const int t = gw + (k / kCpChunks) * nw;
      const int64_t off = static_cast<int64_t>(t) * kRowBytes + (k % kCpChunks) * kCpChunk;
      uint8_t* st = ring + (k % kCpStages) * 2 * kCpChunk;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int v = (lane + u * 32) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa(st + v)), "l"(a.own + off + v) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sa(st + kCpChunk + v)), "l"(a.peer + off + v)
                     : "memory");
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  issue(0);
  issue(1);
  for (int j = 0; j < n; ++j) {
    issue(j + 2);  // into the stage this lane finished reading in iteration j - 1
    asm volatile("cp.async.wait_group 2;" ::: "memory");
    const int t = gw + (j / kCpChunks) * nw;
    const float w0 = a.w0[t], w1 = a.w1[t];
    const int4* st = reinterpret_cast<const int4*>(ring + (j % kCpStages) * 2 * kCpChunk);
    int4* d = reinterpret_cast<int4*>(a.out + static_cast<int64_t>(t) * kRowBytes + (j % kCpChunks) * kCpChunk);
#pragma unroll
    for (int u = 0; u < 4; ++u) d[lane + u * 32] = mix8(st[lane + u * 32], st[kCpChunk / 16 + lane + u * 32], w0, w1);
  }
}

// ---- checking on the device: bitwise mismatches and max |a - b| (NaN counts as infinite) --------------
struct Diff {
  unsigned long long count;
  unsigned maxbits;
};
__global__ void compare_kernel(const __nv_bfloat16* x, const __nv_bfloat16* y, int64_t n, Diff* diff) {
  unsigned long long c = 0;
  float m = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    if (__bfloat16_as_ushort(x[i]) != __bfloat16_as_ushort(y[i])) ++c;
    const float e = fabsf(__bfloat162float(x[i]) - __bfloat162float(y[i]));
    m = e != e ? INFINITY : fmaxf(m, e);
  }
  if (c) atomicAdd(&diff->count, c);
  atomicMax(&diff->maxbits, __float_as_uint(m));  // non-negative floats order like their bits
}

// ---- host --------------------------------------------------------------------------------------------
struct Cfg {
  std::string variant;
  int S, B;
};
static size_t smem_of(const Cfg& c) {
  if (c.variant == "tma" || c.variant == "tma-both") return tma_smem(c.S, c.B, c.variant == "tma-both");
  return c.variant == "cpasync" ? kCpSmem : 0;
}
template <bool kBoth>
static void launch_tma(const Args& a, int blocks, int S, int B) {
  const size_t sm = tma_smem(S, B, kBoth);
  switch (B) {
    case 1024: tma_kernel<1024, kBoth><<<blocks, kThreads, sm>>>(a, S); break;
    case 1792: tma_kernel<1792, kBoth><<<blocks, kThreads, sm>>>(a, S); break;
    case 2048: tma_kernel<2048, kBoth><<<blocks, kThreads, sm>>>(a, S); break;
    case 3584: tma_kernel<3584, kBoth><<<blocks, kThreads, sm>>>(a, S); break;
    case 7168: tma_kernel<7168, kBoth><<<blocks, kThreads, sm>>>(a, S); break;
    default: std::fprintf(stderr, "segment bytes %d not built (1024, 1792, 2048, 3584, 7168)\n", B); std::exit(2);
  }
}
static void launch(const Cfg& c, const Args& a, int blocks) {
  if (c.variant == "regs4") regs_kernel<4><<<blocks, kThreads>>>(a);
  else if (c.variant == "regs8") regs_kernel<8><<<blocks, kThreads>>>(a);
  else if (c.variant == "tma") launch_tma<false>(a, blocks, c.S, c.B);
  else if (c.variant == "tma-both") launch_tma<true>(a, blocks, c.S, c.B);
  else cpasync_kernel<<<blocks, kThreads, kCpSmem>>>(a);
}
static void allow_smem(int optin) {  // every kernel that takes dynamic shared memory may use all of it
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  CK(cudaFuncSetAttribute(cpasync_kernel, attr, optin));
#define ALLOW(B)                                                \
  CK(cudaFuncSetAttribute(tma_kernel<B, false>, attr, optin)); \
  CK(cudaFuncSetAttribute(tma_kernel<B, true>, attr, optin));
  ALLOW(1024) ALLOW(1792) ALLOW(2048) ALLOW(3584) ALLOW(7168)
#undef ALLOW
}

static uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint16_t to_bf16(float f) {  // round to nearest even, like __floats2bfloat162_rn (no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static bool has(const std::vector<std::string>& v, const char* w) { return std::find(v.begin(), v.end(), w) != v.end(); }

// A cuMem allocation on GPU 1 made and mapped the way SymmetricBuffer does it (pinned, POSIX-fd
// exportable, size and VA alignment = RECOMMENDED granularity, offset 0, read/write access), and
// optionally mapped again at another VA from a handle re-imported from its exported fd: what a peer
// process maps.
struct Vmm {
  CUmemGenericAllocationHandle h = 0, h2 = 0;
  CUdeviceptr va = 0, va2 = 0;  // nonzero once mapped and accessible
  size_t size = 0, gran = 0;
};
static bool reserve_map(CUdeviceptr* out, const Vmm& m, CUmemGenericAllocationHandle h) {
  CUmemAccessDesc acc[2] = {};
  for (int d = 0; d < 2; ++d) {
    acc[d].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc[d].location.id = d;
    acc[d].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CUdeviceptr va = 0;
  if (!CU(cuMemAddressReserve(&va, m.size, m.gran, 0, 0))) return false;
  if (CU(cuMemMap(va, m.size, 0, h, 0))) {
    if (CU(cuMemSetAccess(va, m.size, acc, 2))) return (*out = va), true;
    CU(cuMemUnmap(va, m.size));
  }
  CU(cuMemAddressFree(va, m.size));
  return false;
}
static void make_vmm(Vmm& m, size_t bytes, bool want_fd) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 1;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (!CU(cuMemGetAllocationGranularity(&m.gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))) return;
  m.size = (bytes + m.gran - 1) / m.gran * m.gran;
  if (!CU(cuMemCreate(&m.h, m.size, &prop, 0))) return (void)(m.h = 0);
  if (!reserve_map(&m.va, m, m.h)) std::printf("# vmm: mapping failed (see stderr), skipped\n");
  int fd = -1;
  if (!want_fd) return;
  if (!CU(cuMemExportToShareableHandle(&fd, m.h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)))
    return (void)std::printf("# vmm-fd: cuMemExportToShareableHandle(POSIX_FD) failed (see stderr), skipped\n");
  const bool ok = CU(cuMemImportFromShareableHandle(&m.h2, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  close(fd);  // the imported handle holds its own reference, as in SymmetricBuffer
  if (!ok) m.h2 = 0;
  if (!ok || !reserve_map(&m.va2, m, m.h2)) std::printf("# vmm-fd: import or mapping failed (see stderr), skipped\n");
}
static void free_vmm(Vmm& m) {
  for (CUdeviceptr va : {m.va, m.va2})
    if (va) CU(cuMemUnmap(va, m.size)) && CU(cuMemAddressFree(va, m.size));
  if (m.h2) CU(cuMemRelease(m.h2));
  if (m.h) CU(cuMemRelease(m.h));
}

constexpr int kWarmup = 10, kTimed = 50;

// median and minimum over kTimed launches, each between its own pair of events
static float time_us(const Cfg& c, const Args& a, int blocks, float* min_us) {
  static std::vector<cudaEvent_t> ev;
  for (size_t i = ev.size(); i < 2 * kTimed; ++i) CK(cudaEventCreate(&ev.emplace_back()));
  for (int i = 0; i < kWarmup; ++i) launch(c, a, blocks);
  for (int i = 0; i < kTimed; ++i) {
    CK(cudaEventRecord(ev[2 * i]));
    launch(c, a, blocks);
    CK(cudaEventRecord(ev[2 * i + 1]));
  }
  CK(cudaGetLastError());
  CK(cudaEventSynchronize(ev[2 * kTimed - 1]));
  std::vector<float> v(kTimed);
  for (int i = 0; i < kTimed; ++i) {
    CK(cudaEventElapsedTime(&v[i], ev[2 * i], ev[2 * i + 1]));
    v[i] *= 1000.f;
  }
  std::sort(v.begin(), v.end());
  *min_us = v[0];
  return v[kTimed / 2];
}

int main(int argc, char** argv) {
  std::vector<std::string> blocks_s = comma_list("16,24,32,64,132"), variants = comma_list("regs4,regs8,tma,tma-both,cpasync"),
                           kinds = comma_list("vmm,vmm-fd,malloc,local");
  // S x B per warp ring.  With 16 warps, S * B (2 * S * B for tma-both) must stay under ~14.2 KB to fit in
  // 227 KB, so 6x3584 and 3x7168 (336 KB) cannot run; 4x3584, 8x1792 and 2x7168 all hold 14 KB per warp.
  std::vector<std::string> tma = comma_list("2x3584,4x3584,8x1792,2x7168"), tma_both = comma_list("2x3584,4x1792");
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    auto* dst = k == "--blocks" ? &blocks_s : k == "--variants" ? &variants : k == "--kinds" ? &kinds
              : k == "--tma" ? &tma : k == "--tma-both" ? &tma_both : nullptr;
    if (!dst || i + 1 >= argc) {
      std::fprintf(stderr, "usage: %s [--blocks 24,32] [--variants regs4,regs8,tma,tma-both,cpasync] "
                   "[--kinds vmm,vmm-fd,malloc,local] [--tma SxB,...] [--tma-both SxB,...]\n", argv[0]);
      return 2;
    }
    *dst = comma_list(argv[i + 1]);
  }
  std::vector<Cfg> cfgs;
  for (const auto& var : variants) {
    if (var == "regs4" || var == "regs8") cfgs.push_back({var, 0, 0});
    else if (var == "cpasync") cfgs.push_back({var, kCpStages, kCpChunk});
    else if (var == "tma" || var == "tma-both")
      for (const auto& sb : var == "tma" ? tma : tma_both) {
        const Cfg c{var, std::atoi(sb.c_str()), std::atoi(sb.c_str() + std::min(sb.find('x') + 1, sb.size()))};
        if (c.S < 1 || !has(comma_list("1024,1792,2048,3584,7168"), std::to_string(c.B).c_str()))
          return std::fprintf(stderr, "bad %s config %s: SxB with B in 1024,1792,2048,3584,7168\n", var.c_str(), sb.c_str()), 2;
        cfgs.push_back(c);
      }
    else return std::fprintf(stderr, "unknown variant %s\n", var.c_str()), 2;
  }
  for (const auto& k : kinds)
    if (!has(comma_list("vmm,vmm-fd,malloc,local"), k.c_str())) return std::fprintf(stderr, "unknown kind %s\n", k.c_str()), 2;

  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  if (ndev < 2) return std::fprintf(stderr, "pull_peer needs 2 GPUs (the peer rows live on GPU 1), found %d\n", ndev), 1;
  if (!CU(cuInit(0))) return 1;
  int can01 = 0, can10 = 0;
  CK(cudaDeviceCanAccessPeer(&can01, 0, 1));
  CK(cudaDeviceCanAccessPeer(&can10, 1, 0));
  if (!can01 || !can10) return std::fprintf(stderr, "GPUs 0 and 1 cannot access each other (%d/%d)\n", can01, can10), 1;
  for (int d : {1, 0}) {  // both primary contexts; GPU 0's stays current
    CK(cudaSetDevice(d));
    CK(cudaFree(nullptr));
  }
  cudaDeviceProp p0, p1;
  CK(cudaGetDeviceProperties(&p0, 0));
  CK(cudaGetDeviceProperties(&p1, 1));
  int optin = 0;
  CK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  std::printf("# GPU 0 %s (%d SMs), GPU 1 %s; %d tokens x %d B; dynamic smem per block up to %d B\n", p0.name,
              p0.multiProcessorCount, p1.name, kTokens, kRowBytes, optin);
  allow_smem(optin);

  // inputs, and the expected output in mix8's order (mul, then fma)
  const size_t n = static_cast<size_t>(kTokens) * kHidden, bytes = n * 2;
  std::vector<uint16_t> h_own(n), h_peer(n), h_exp(n), h_got(n);
  std::vector<float> h_w0(kTokens), h_w1(kTokens);
  uint64_t seed = 0x5eed;
  auto uni = [&] { return static_cast<float>(splitmix(seed) >> 40) * (1.f / 16777216.f); };  // [0, 1)
  for (auto& x : h_own) x = to_bf16(4.f * uni() - 2.f);
  for (auto& x : h_peer) x = to_bf16(4.f * uni() - 2.f);
  for (int t = 0; t < kTokens; ++t) h_w0[t] = 0.25f + uni(), h_w1[t] = 0.25f + uni();
  for (size_t i = 0; i < n; ++i) {
    const float m = h_w0[i / kHidden] * from_bf16(h_own[i]);
    h_exp[i] = to_bf16(std::fma(h_w1[i / kHidden], from_bf16(h_peer[i]), m));
  }

  uint8_t *own, *out, *ref, *local_peer, *malloc_peer;
  float* w;  // w0 then w1
  Diff* diff;
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&malloc_peer, bytes));
  CK(cudaSetDevice(0));
  for (uint8_t** b : {&own, &out, &ref, &local_peer}) CK(cudaMalloc(b, bytes));
  CK(cudaMalloc(&w, 2 * kTokens * 4));
  CK(cudaMalloc(&diff, sizeof(Diff)));
  CK(cudaMemcpy(own, h_own.data(), bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(local_peer, h_peer.data(), bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(malloc_peer, h_peer.data(), bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w, h_w0.data(), kTokens * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(w + kTokens, h_w1.data(), kTokens * 4, cudaMemcpyHostToDevice));

  Vmm vmm;
  if (has(kinds, "vmm") || has(kinds, "vmm-fd")) {
    CK(cudaSetDevice(1));  // made from GPU 1's context, as by the rank that owns it
    make_vmm(vmm, bytes, has(kinds, "vmm-fd"));
    CK(cudaSetDevice(0));
    // both VAs show the same physical memory
    const CUdeviceptr fill = vmm.va ? vmm.va : vmm.va2;
    if (fill && !CU(cuMemcpyHtoD(fill, h_peer.data(), bytes))) return 1;
    if (fill) std::printf("# vmm: %zu B, RECOMMENDED granularity %zu B\n", vmm.size, vmm.gran);
  }

  bool bad = false, peer_on = false;
  std::printf("# kind variant S B blocks p50_us min_us GBps ndiff result\n");
  for (const auto& kind : kinds) {
    const uint8_t* peer = kind == "local"    ? local_peer
                          : kind == "malloc" ? malloc_peer
                          : reinterpret_cast<const uint8_t*>(kind == "vmm" ? vmm.va : vmm.va2);
    if (!peer) {
      std::printf("# %s: not available, skipped\n", kind.c_str());
      continue;
    }
    if (kind == "malloc" && !peer_on) {
      // only now, so that VMM kinds listed before it run as in a process that reaches peers through cuMem only
      CK(cudaSetDevice(1));
      CK(cudaDeviceEnablePeerAccess(0, 0));
      CK(cudaSetDevice(0));
      CK(cudaDeviceEnablePeerAccess(1, 0));
      peer_on = true;
    }
    // this kind's reference: regs4, itself checked bit for bit against the host
    Args a{own, peer, w, w + kTokens, ref, kTokens};
    CK(cudaMemset(ref, 0xff, bytes));
    launch({"regs4", 0, 0}, a, 24);
    CK(cudaGetLastError());
    CK(cudaMemcpy(h_got.data(), ref, bytes, cudaMemcpyDeviceToHost));
    if (h_got != h_exp) {
      const size_t i = std::mismatch(h_got.begin(), h_got.end(), h_exp.begin()).first - h_got.begin();
      std::printf("# %s: regs4 differs from the host at element %zu (%04x, want %04x): FAIL\n", kind.c_str(), i,
                  h_got[i], h_exp[i]);
      bad = true;
    }
    a.out = out;
    const std::vector<std::string> bl = kind == "local" ? comma_list("24") : blocks_s;
    for (const Cfg& c : cfgs) {
      if (smem_of(c) > static_cast<size_t>(optin)) {
        std::printf("# %s %s S=%d B=%d needs %zu B of shared memory > %d: skipped\n", kind.c_str(), c.variant.c_str(),
                    c.S, c.B, smem_of(c), optin);
        continue;
      }
      for (const auto& bs : bl) {
        const int blocks = std::atoi(bs.c_str());
        CK(cudaMemset(out, 0xff, bytes));  // bf16 NaNs, so a kernel that writes nothing fails
        float mn;
        const float p50 = time_us(c, a, blocks, &mn);
        CK(cudaMemset(diff, 0, sizeof(Diff)));
        compare_kernel<<<264, 256>>>(reinterpret_cast<const __nv_bfloat16*>(out),
                                     reinterpret_cast<const __nv_bfloat16*>(ref), n, diff);
        CK(cudaGetLastError());
        Diff hd;
        CK(cudaMemcpy(&hd, diff, sizeof(Diff), cudaMemcpyDeviceToHost));
        float maxdiff;
        std::memcpy(&maxdiff, &hd.maxbits, 4);
        const bool pass = maxdiff <= 1e-2f;
        bad = bad || !pass;
        const std::string S = c.S ? std::to_string(c.S) : "-", B = c.B ? std::to_string(c.B) : "-";
        std::printf("%-6s %-8s %2s %4s %4d %9.1f %9.1f %7.1f %9llu %s\n", kind.c_str(), c.variant.c_str(), S.c_str(),
                    B.c_str(), blocks, p50, mn, bytes / (p50 * 1e3), hd.count, pass ? "PASS" : "FAIL");
        std::fflush(stdout);
      }
    }
  }
  free_vmm(vmm);
  std::printf("done\n");
  return bad ? 1 : 0;
}
