// Can the SMs of a prefill dispatch lay received rows out while they send rows to peer GPUs, and do
// TMA bulk copies (on the sending or on the copying side) leave the SMs' issue slots and memory pipes
// free for the other?
//
// The copied standard dispatch receives while it sends: some of each block's 16 warps copy the peers'
// rows into the output while the others send (4 and 12 here), and the copy that is left when the sends
// end adds to the dispatch's time (docs/performance.md).  This program takes the protocol out: GPU 0
// sends `rows` rows of 14,336 bytes, each to `fan` of the other GPUs (row r to peers r, r + 1, ...
// modulo their count), while its other warps copy rows x fan local rows (what it would receive), and
// times
//
//   send          every warp sends (16-byte warp stores, or TMA: one lane per warp loads a piece into
//                 shared memory and bulk-stores it to each destination)
//   copy          every warp copies (16-byte warp copies, or TMA as the sends)
//   both          warps [0, S) of every block send, the rest copy, from the start: warp stores on both
//                 sides, TMA sends beside warp copies, and warp-store sends beside TMA copies
//
// on `blocks` blocks of 512 threads.  Per configuration: the kernel's p50 (CUDA events), when the
// sends and the copy ended (the GPU's global timer, from the first warp's start; medians), and the
// share of the copy done by the time the sends ended.  Every run's rows are checked byte for byte on
// the peers and in the copy (`check ...`); exit code 1 on a difference.
//
// Build and run (2 to 4 GPUs, no torch):
//   nvcc -std=c++17 -O3 -arch=sm_90 bench/microbench/send_copy.cu -o sc && ./sc
//   options: --rows 4096 --fan 1,2,3 --blocks 24 --send-warps 8,11,12,14 --reps 20
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "check.cuh"

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kRowBytes = 14336;
constexpr int kMaxPeers = 3;
constexpr int kStages = 4;
constexpr int kPiece = kRowBytes / 4;  // 3584: 16 warps x 4 stages x 3.5 KB = 224 KB of shared memory
constexpr int kPieces = kRowBytes / kPiece;

enum Stat { kStart, kSendEnd, kCopyEnd, kCopyRowsBySendEnd, kSendWarpsDone, kStats };

struct Args {
  const uint8_t* src;            // [rows][kRowBytes] on this GPU
  uint8_t* peer[kMaxPeers];      // [rows][kRowBytes] on each peer
  int peers, rows, fan;
  const uint8_t* copy_src;       // [copy_rows][kRowBytes], local
  uint8_t* copy_dst;             // [copy_rows][kRowBytes], local
  int copy_rows;
  int send_warps;                // per block: kWarps sends only, 0 copies only
  bool tma;                      // the sends by TMA
  bool copy_tma;                 // the copy by TMA
  unsigned long long* stats;     // [kStats]
};

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint8_t* destination(const Args& a, int r, int j) {
  return a.peer[(r + j) % a.peers] + static_cast<int64_t>(r) * kRowBytes;
}

// 16-byte stores by the whole warp, 4 loads in flight per lane (the kernels' send-side warp copy)
__device__ void send_regs(const Args& a, int gw, int nw, int lane) {
  constexpr int n = kRowBytes / 16, kUnroll = 4;
  for (int r = gw; r < a.rows; r += nw) {
    const int4* s = reinterpret_cast<const int4*>(a.src + static_cast<int64_t>(r) * kRowBytes);
    for (int i = lane; i < n; i += kUnroll * 32) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + u * 32 < n) v[u] = s[i + u * 32];
      for (int j = 0; j < a.fan; ++j) {
        int4* o = reinterpret_cast<int4*>(destination(a, r, j));
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i + u * 32 < n) o[i + u * 32] = v[u];
      }
    }
  }
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Lane 0 only: rows gw, gw + nw, ... of `src` (`rows` of them) to `fan` destinations each (dst(r, j) is
// row r's j-th), through a ring of kStages pieces; loads run kStages - 2 pieces ahead of the stores, and
// a stage is refilled once the stores that read it are done reading.  `issued(r)`: row r's stores issued.
template <typename Dst, typename Issued>
__device__ void tma_rows(const uint8_t* src, int rows, int fan, int gw, int nw, uint8_t* ring, uint64_t* bars,
                         Dst dst, Issued issued) {
  for (int s = 0; s < kStages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bars + s)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int my_rows = rows > gw ? (rows - gw + nw - 1) / nw : 0;
  const int pieces = my_rows * kPieces;
  auto row_of = [&](int i) { return gw + (i / kPieces) * nw; };
  auto load = [&](int i) {
    const uint32_t bar = smem_u32(bars + i % kStages);
    const uint8_t* g = src + static_cast<int64_t>(row_of(i)) * kRowBytes + (i % kPieces) * kPiece;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kPiece) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(ring + (i % kStages) * kPiece)),
                 "l"(g), "r"(kPiece), "r"(bar)
                 : "memory");
  };
  auto store = [&](int i) {
    const uint32_t bar = smem_u32(bars + i % kStages), phase = (i / kStages) & 1;
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done)
                   : "r"(bar), "r"(phase)
                   : "memory");
    for (int j = 0; j < fan; ++j)
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                       dst(row_of(i), j) + (i % kPieces) * kPiece),
                   "r"(smem_u32(ring + (i % kStages) * kPiece)), "r"(kPiece)
                   : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (i % kPieces == kPieces - 1) issued(row_of(i));
  };
  constexpr int kAhead = kStages - 2;
  for (int i = 0; i < pieces; ++i) {
    if (i >= kStages) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // piece i - kStages read
    load(i);
    if (i >= kAhead) store(i - kAhead);
  }
  for (int j = max(0, pieces - kAhead); j < pieces; ++j) store(j);
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ void count_copied_row(const Args& a, int senders) {
  if (senders > 0 &&
      *reinterpret_cast<volatile unsigned long long*>(a.stats + kSendWarpsDone) < static_cast<unsigned long long>(senders))
    atomicAdd(a.stats + kCopyRowsBySendEnd, 1ull);
}

__global__ void __launch_bounds__(kThreads, 1) send_copy(Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[kWarps][kStages];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) atomicMin(a.stats + kStart, now_ns());
  const int senders = gridDim.x * a.send_warps;
  if (warp < a.send_warps) {
    const int gw = blockIdx.x * a.send_warps + warp;
    if (a.tma) {
      if (lane == 0)
        tma_rows(a.src, a.rows, a.fan, gw, senders, smem + static_cast<size_t>(warp) * kStages * kPiece, bars[warp],
                 [&](int r, int j) { return destination(a, r, j); }, [](int) {});
    } else {
      send_regs(a, gw, senders, lane);
    }
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();  // the warp's stores done before it counts as finished
      atomicMax(a.stats + kSendEnd, now_ns());
      atomicAdd(a.stats + kSendWarpsDone, 1ull);
    }
    return;
  }
  const int per_block = kWarps - a.send_warps;
  const int gw = blockIdx.x * per_block + warp - a.send_warps, nw = gridDim.x * per_block;
  if (a.copy_tma) {
    if (lane == 0)
      tma_rows(a.copy_src, a.copy_rows, 1, gw, nw, smem + static_cast<size_t>(warp) * kStages * kPiece, bars[warp],
               [&](int r, int) { return a.copy_dst + static_cast<int64_t>(r) * kRowBytes; },
               [&](int) { count_copied_row(a, senders); });
    __syncwarp();
    if (lane == 0) atomicMax(a.stats + kCopyEnd, now_ns());
    return;
  }
  for (int r = gw; r < a.copy_rows; r += nw) {
    warp_copy_row(a.copy_src + static_cast<int64_t>(r) * kRowBytes, a.copy_dst + static_cast<int64_t>(r) * kRowBytes,
                  kRowBytes, lane);
    if (lane == 0) count_copied_row(a, senders);
  }
  __syncwarp();
  if (lane == 0) atomicMax(a.stats + kCopyEnd, now_ns());
}

struct Result {
  float kernel_us, send_end_us, copy_end_us, copy_share;
};

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.f : v[v.size() / 2];
}

static Result run(Args a, int blocks, int reps, size_t smem) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const unsigned long long init[kStats] = {~0ull, 0, 0, 0, 0};
  std::vector<float> k, s, c, share;
  for (int i = 0; i < reps + 3; ++i) {
    CK(cudaMemcpy(a.stats, init, sizeof(init), cudaMemcpyHostToDevice));
    CK(cudaEventRecord(e0));
    send_copy<<<blocks, kThreads, smem>>>(a);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    if (i < 3) continue;
    unsigned long long st[kStats];
    CK(cudaMemcpy(st, a.stats, sizeof(st), cudaMemcpyDeviceToHost));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    k.push_back(ms * 1e3f);
    if (a.send_warps > 0) s.push_back((st[kSendEnd] - st[kStart]) / 1e3f);
    if (a.send_warps < kWarps) c.push_back((st[kCopyEnd] - st[kStart]) / 1e3f);
    if (a.send_warps > 0 && a.send_warps < kWarps) share.push_back(static_cast<float>(st[kCopyRowsBySendEnd]) / a.copy_rows);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return {median(k), median(s), median(c), median(share)};
}

// Every row the last run sent, on its peers, and the copy, against their sources
static bool check(const Args& a, const std::vector<uint8_t>& src, const std::vector<uint8_t>& copy_src) {
  std::vector<uint8_t> row(kRowBytes);
  bool ok = true;
  for (int r = 0; r < (a.send_warps > 0 ? a.rows : 0) && ok; ++r)
    for (int j = 0; j < a.fan && ok; ++j) {
      CK(cudaMemcpy(row.data(), a.peer[(r + j) % a.peers] + static_cast<int64_t>(r) * kRowBytes, kRowBytes,
                    cudaMemcpyDefault));
      ok = std::memcmp(row.data(), src.data() + static_cast<size_t>(r) * kRowBytes, kRowBytes) == 0;
    }
  if (a.send_warps < kWarps && ok) {
    std::vector<uint8_t> out(copy_src.size());
    CK(cudaMemcpy(out.data(), a.copy_dst, out.size(), cudaMemcpyDeviceToHost));
    ok = out == copy_src;
  }
  return ok;
}

int main(int argc, char** argv) {
  int rows = 4096, blocks = 24, reps = 20;
  std::string fans = "1,2,3", send_warps = "8,11,12,14";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rows") rows = std::atoi(v.c_str());
    else if (k == "--blocks") blocks = std::atoi(v.c_str());
    else if (k == "--reps") reps = std::atoi(v.c_str());
    else if (k == "--fan") fans = v;
    else if (k == "--send-warps") send_warps = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  const int peers = std::min(kMaxPeers, ndev - 1);
  if (peers < 1 || rows < 1 || blocks < 1 || reps < 1) {
    std::fprintf(stderr, "needs 2 GPUs or more and positive --rows, --blocks, --reps\n");
    return 2;
  }
  Args a{};
  a.peers = peers;
  a.rows = rows;
  const size_t row_bytes = static_cast<size_t>(rows) * kRowBytes;
  for (int p = 0; p < peers; ++p) {
    int can = 0;
    CK(cudaDeviceCanAccessPeer(&can, 0, p + 1));
    if (!can) {
      std::fprintf(stderr, "GPU 0 cannot map GPU %d\n", p + 1);
      return 2;
    }
    CK(cudaSetDevice(p + 1));
    CK(cudaMalloc(&a.peer[p], row_bytes));
    CK(cudaSetDevice(0));
    CK(cudaDeviceEnablePeerAccess(p + 1, 0));
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s x %d; %d rows of %d B, each to `fan` of %d peers; %d blocks\n", prop.name, ndev, rows,
              kRowBytes, peers, blocks);
  std::vector<uint8_t> src(row_bytes);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>((i * 2654435761u) >> 11);
  uint8_t* d_src;
  CK(cudaMalloc(&d_src, row_bytes));
  CK(cudaMemcpy(d_src, src.data(), row_bytes, cudaMemcpyHostToDevice));
  a.src = d_src;
  CK(cudaMalloc(&a.stats, kStats * sizeof(unsigned long long)));
  const size_t smem = static_cast<size_t>(kWarps) * kStages * kPiece;
  CK(cudaFuncSetAttribute(send_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));

  bool all_ok = true;
  std::printf("%-5s %-4s %-4s %3s %10s %8s %10s %10s %10s\n", "mode", "send", "copy", "fan", "send_warps", "p50_us",
              "sends_end", "copy_end", "copy_done");
  for (const std::string& f : comma_list(fans)) {
    a.fan = std::min(std::atoi(f.c_str()), peers);
    if (a.fan < 1) continue;
    a.copy_rows = rows * a.fan;
    const size_t copy_bytes = static_cast<size_t>(a.copy_rows) * kRowBytes;
    std::vector<uint8_t> copy_src(copy_bytes);
    for (size_t i = 0; i < copy_bytes; ++i) copy_src[i] = static_cast<uint8_t>((i * 40503u) >> 7);
    uint8_t *d_csrc, *d_cdst;
    CK(cudaMalloc(&d_csrc, copy_bytes));
    CK(cudaMalloc(&d_cdst, copy_bytes));
    CK(cudaMemcpy(d_csrc, copy_src.data(), copy_bytes, cudaMemcpyHostToDevice));
    a.copy_src = d_csrc;
    a.copy_dst = d_cdst;
    struct Config {
      const char* mode;
      int send_warps;
      bool tma, copy_tma;
    };
    std::vector<Config> configs = {{"send", kWarps, false, false}, {"send", kWarps, true, false},
                                   {"copy", 0, false, false}, {"copy", 0, false, true}};
    for (const std::string& s : comma_list(send_warps)) {
      const int sw = std::atoi(s.c_str());
      if (sw < 1 || sw >= kWarps) continue;
      configs.push_back({"both", sw, false, false});
      configs.push_back({"both", sw, true, false});
      configs.push_back({"both", sw, false, true});
    }
    for (const Config& c : configs) {
      for (int p = 0; p < peers; ++p) CK(cudaMemset(a.peer[p], 0, row_bytes));
      CK(cudaMemset(d_cdst, 0, copy_bytes));
      a.send_warps = c.send_warps;
      a.tma = c.tma;
      a.copy_tma = c.copy_tma;
      const Result r = run(a, blocks, reps, smem);
      const bool ok = check(a, src, copy_src);
      all_ok = all_ok && ok;
      const bool sends = c.send_warps > 0, copies = c.send_warps < kWarps;
      std::printf("%-5s %-4s %-4s %3d %10d %8.1f %10.1f %10.1f %9.0f%%%s\n", c.mode,
                  sends ? (c.tma ? "tma" : "regs") : "-", copies ? (c.copy_tma ? "tma" : "regs") : "-", a.fan,
                  c.send_warps, r.kernel_us, sends ? r.send_end_us : 0.f, copies ? r.copy_end_us : 0.f,
                  sends && copies ? 100.f * r.copy_share : 0.f, ok ? "" : "  MISMATCH");
    }
    CK(cudaFree(d_csrc));
    CK(cudaFree(d_cdst));
  }
  std::printf("check %s\ndone\n", all_ok ? "identical" : "DIFFERENT");
  return all_ok ? 0 : 1;
}
