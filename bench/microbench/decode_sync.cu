// What a decode-sized dispatch costs below its layout: the sends to every peer plus the signal that
// lets a peer use them, by signalling protocol, against the sends alone and an empty kernel.
//
// One process drives every GPU (one host thread each, peer access on).  Each op, on every GPU: the
// warps send this rank's rows to every peer's receive buffer (16-byte stores, a warp per row, each
// lane's loads issued before its stores), then the peers are told, then every block waits until each
// peer has told it.  No receive layout: that is the kernels' own cost on top.
//   empty    the kernel only (launch, block scheduling, drain inside a graph)
//   send     the sends, nobody waits (the floor of moving the bytes from these SMs)
//   grid     as the library does: each block fences and arrives on a grid counter; the last block
//            stores the op's number into one flag per peer; every block waits for every peer's flag
//   block    each block fences, then adds 1 to a counter on every peer (remote atomics); every block
//            waits for the counters to reach the op's number x blocks: no last block to wait for
//   warp     the same per warp, each warp once its own rows are sent: no block barrier either
// Ops are CUDA-graph nodes, R per graph; the time per op is a replay's time over R (median of the
// replays, the slowest GPU).  The received rows are checked against the senders' after each variant.
// Prints `variant world rows_per_peer blocks us_per_op result` lines, then `done`; exit code 1 on any
// FAIL (wrong rows or a wait that gave up).
//
// Build and run (2 or more GPUs with peer access, no torch):
//   nvcc -std=c++17 -O3 -arch=sm_90 bench/microbench/decode_sync.cu -o ds && ./ds
//   options: --world 2,4  --blocks 32,64,132  --tokens 128  --variants grid,block  --graph-ops 20
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.cuh"

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kRowBytes = 7168 * 2;  // DeepSeek-V3's hidden size, bf16
constexpr int kRowVecs = kRowBytes / 16;
constexpr int kVecsPerLane = kRowVecs / 32;  // 28
constexpr int kMaxWorld = 8;
constexpr uint64_t kGiveUpNs = 2000000000ull;
static_assert(kRowVecs % 32 == 0, "a row is whole vectors per lane");

enum Variant { kEmpty, kSend, kGrid, kBlock, kWarp };
static const char* kNames[] = {"empty", "send", "grid", "block", "warp"};

struct Args {
  int rank, world, rows, variant;
  const int4* src;                      // this rank's rows, [rows][kRowVecs]
  int4* dst[kMaxWorld];                 // peer p's receive buffer at this rank's slot
  unsigned long long* tell[kMaxWorld];  // peer p's flag / counter for this rank
  unsigned long long* told;             // [world]: what each peer stored or added here
  unsigned long long* state;            // [0] ops finished, [1] grid arrivals, [2] blocks exited, [3] gave up
};

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long ld_acquire_sys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Thread 0 of the block: wait until every peer's word here reaches ``want``.
__device__ void wait_told(const Args& a, unsigned long long want) {
  const uint64_t deadline = now_ns() + kGiveUpNs;
  for (int p = 0; p < a.world; ++p) {
    if (p == a.rank) continue;
    uint32_t spins = 0;
    while (ld_acquire_sys(a.told + p) < want)
      if ((++spins & 255u) == 0 && now_ns() > deadline) {
        atomicAdd(a.state + 3, 1ull);
        break;
      }
  }
}

__global__ void __launch_bounds__(kThreads, 1) op_kernel(const Args a) {
  const int lane = threadIdx.x & 31;
  const unsigned long long op = *reinterpret_cast<volatile unsigned long long*>(a.state) + 1;
  const unsigned long long grid = gridDim.x;
  if (a.variant != kEmpty) {
    const int64_t items = static_cast<int64_t>(a.world - 1) * a.rows;
    const int nwarps = gridDim.x * kWarps;
    for (int64_t i = blockIdx.x * kWarps + (threadIdx.x >> 5); i < items; i += nwarps) {
      const int peer = (a.rank + 1 + static_cast<int>(i / a.rows)) % a.world;
      const int row = static_cast<int>(i % a.rows);
      const int4* s = a.src + static_cast<int64_t>(row) * kRowVecs;
      int4* d = a.dst[peer] + static_cast<int64_t>(row) * kRowVecs;
      int4 v[kVecsPerLane];
#pragma unroll
      for (int j = 0; j < kVecsPerLane; ++j) v[j] = s[j * 32 + lane];
#pragma unroll
      for (int j = 0; j < kVecsPerLane; ++j) d[j * 32 + lane] = v[j];
    }
    if (a.variant == kWarp) {
      __syncwarp();
      if (lane == 0) {
        __threadfence_system();  // this warp's stores land before its count
        for (int p = 0; p < a.world; ++p)
          if (p != a.rank) atomicAdd_system(a.tell[p], 1ull);
      }
      __syncthreads();
      if (threadIdx.x == 0) wait_told(a, op * grid * kWarps);
    } else if (a.variant == kBlock) {
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();  // the block's stores (seen through the barrier) land before its count
        for (int p = 0; p < a.world; ++p)
          if (p != a.rank) atomicAdd_system(a.tell[p], 1ull);
        wait_told(a, op * grid);
      }
    } else if (a.variant == kGrid) {
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();
        const unsigned long long old = atomicAdd(a.state + 1, 1ull);
        if ((old + 1) % grid == 0) {  // the last block: every block's stores are out
          asm volatile("fence.acq_rel.gpu;" ::: "memory");
          for (int p = 0; p < a.world; ++p)
            if (p != a.rank) st_release_sys(a.tell[p], op);
        }
        wait_told(a, op);
      }
    }
  }
  __syncthreads();
  // the last block to leave counts the op (every block read the op number at its start)
  if (threadIdx.x == 0 && (atomicAdd(a.state + 2, 1ull) + 1) % grid == 0)
    *reinterpret_cast<volatile unsigned long long*>(a.state) = op;
}

struct Rank {
  int dev;
  cudaStream_t stream;
  int4* src;
  int4* recv;                // [world][rows][kRowVecs]
  unsigned long long* told;  // [kMaxVariants][world]: a fresh set of words per variant
  unsigned long long* state;
};

static std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p) ++p;
  }
  return v;
}

// Every host thread reaches it before any goes on (a generation counter, C++17).
struct Barrier {
  std::atomic<int> count{0}, gen{0};
  int n;
  explicit Barrier(int n_) : n(n_) {}
  void wait() {
    const int g = gen.load();
    if (count.fetch_add(1) + 1 == n) {
      count.store(0);
      gen.fetch_add(1);
    } else {
      while (gen.load() == g) std::this_thread::yield();
    }
  }
};

int main(int argc, char** argv) {
  std::vector<int> worlds = {2}, blocks = {64}, variants = {kEmpty, kSend, kGrid, kBlock, kWarp};
  int tokens = 128, graph_ops = 20, replays = 30;
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  if (ngpu >= 4) worlds = {2, 4};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--world") worlds = parse_list(argv[i + 1]);
    else if (k == "--blocks") blocks = parse_list(argv[i + 1]);
    else if (k == "--tokens") tokens = std::atoi(argv[i + 1]);
    else if (k == "--graph-ops") graph_ops = std::atoi(argv[i + 1]);
    else if (k == "--replays") replays = std::atoi(argv[i + 1]);
    else if (k == "--variants") {
      variants.clear();
      const std::string list = std::string(",") + argv[i + 1] + ",";
      for (int v = kEmpty; v <= kWarp; ++v)
        if (list.find(std::string(",") + kNames[v] + ",") != std::string::npos) variants.push_back(v);
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  bool all_ok = true;
  std::printf("variant world rows_per_peer blocks us_per_op result\n");
  for (const int world : worlds) {
    if (world < 2 || world > std::min(ngpu, kMaxWorld)) {
      std::printf("# world %d skipped: %d GPUs\n", world, ngpu);
      continue;
    }
    // rows each peer gets: tokens with at least one of their 8 experts (of 256) on that peer
    double p_none = 1.0;
    for (int j = 0; j < 8; ++j) p_none *= (256.0 - 256.0 / world - j) / (256.0 - j);
    const int rows = static_cast<int>(tokens * (1.0 - p_none) + 0.5);
    const int nv = kWarp + 1;
    std::vector<Rank> r(world);
    for (int g = 0; g < world; ++g) {
      Rank& x = r[g];
      x.dev = g;
      CK(cudaSetDevice(g));
      for (int p = 0; p < world; ++p)
        if (p != g) {
          const cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
          if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
          (void)cudaGetLastError();
        }
      CK(cudaStreamCreateWithFlags(&x.stream, cudaStreamNonBlocking));
      CK(cudaMalloc(&x.src, static_cast<size_t>(rows) * kRowBytes));
      CK(cudaMalloc(&x.recv, static_cast<size_t>(world) * rows * kRowBytes));
      CK(cudaMalloc(&x.told, sizeof(unsigned long long) * nv * world * blocks.size()));
      CK(cudaMalloc(&x.state, sizeof(unsigned long long) * 4 * nv * blocks.size()));
      CK(cudaMemset(x.told, 0, sizeof(unsigned long long) * nv * world * blocks.size()));
      CK(cudaMemset(x.state, 0, sizeof(unsigned long long) * 4 * nv * blocks.size()));
      std::vector<uint32_t> host(static_cast<size_t>(rows) * kRowBytes / 4);
      for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint32_t>(i * 2654435761u) ^ (0x9e3779b9u * (g + 1));
      CK(cudaMemcpy(x.src, host.data(), static_cast<size_t>(rows) * kRowBytes, cudaMemcpyHostToDevice));
      CK(cudaMemset(x.recv, 0, static_cast<size_t>(world) * rows * kRowBytes));
    }
    for (size_t bi = 0; bi < blocks.size(); ++bi) {
      for (const int v : variants) {
        const size_t slot = bi * nv + v;  // fresh words: counts start at 0 for every (blocks, variant)
        std::vector<double> per_gpu(world, 0.0);
        std::vector<int> gave_up(world, 0);
        Barrier barrier(world);
        std::vector<std::thread> threads;
        for (int g = 0; g < world; ++g)
          threads.emplace_back([&, g] {
            Rank& x = r[g];
            CK(cudaSetDevice(x.dev));
            Args a{};
            a.rank = g;
            a.world = world;
            a.rows = rows;
            a.variant = v;
            a.src = x.src;
            for (int p = 0; p < world; ++p) {
              a.dst[p] = r[p].recv + static_cast<size_t>(g) * rows * kRowVecs;
              a.tell[p] = r[p].told + slot * world + g;
            }
            a.told = x.told + slot * world;
            a.state = x.state + slot * 4;
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CK(cudaStreamBeginCapture(x.stream, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < graph_ops; ++i) op_kernel<<<blocks[bi], kThreads, 0, x.stream>>>(a);
            CK(cudaStreamEndCapture(x.stream, &graph));
            CK(cudaGraphInstantiate(&exec, graph, 0));
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            std::vector<float> ms;
            for (int rep = 0; rep < replays + 5; ++rep) {
              barrier.wait();
              CK(cudaEventRecord(e0, x.stream));
              CK(cudaGraphLaunch(exec, x.stream));
              CK(cudaEventRecord(e1, x.stream));
              CK(cudaEventSynchronize(e1));
              float t = 0.f;
              CK(cudaEventElapsedTime(&t, e0, e1));
              if (rep >= 5) ms.push_back(t);  // the first replays warm up
            }
            std::sort(ms.begin(), ms.end());
            per_gpu[g] = 1000.0 * ms[ms.size() / 2] / graph_ops;
            unsigned long long st[4];
            CK(cudaMemcpy(st, a.state, sizeof(st), cudaMemcpyDeviceToHost));
            gave_up[g] = static_cast<int>(st[3]);
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
            CK(cudaEventDestroy(e0));
            CK(cudaEventDestroy(e1));
          });
        for (auto& t : threads) t.join();
        // the rows each rank received from each peer are that peer's rows
        bool ok = true;
        if (v != kEmpty) {
          std::vector<uint8_t> want(static_cast<size_t>(rows) * kRowBytes), got(want.size());
          for (int g = 0; g < world && ok; ++g)
            for (int p = 0; p < world && ok; ++p) {
              if (p == g) continue;
              CK(cudaSetDevice(p));
              CK(cudaMemcpy(want.data(), r[p].src, want.size(), cudaMemcpyDeviceToHost));
              CK(cudaSetDevice(g));
              CK(cudaMemcpy(got.data(), r[g].recv + static_cast<size_t>(p) * rows * kRowVecs, got.size(),
                            cudaMemcpyDeviceToHost));
              ok = std::memcmp(want.data(), got.data(), want.size()) == 0;
            }
        }
        int gave = 0;
        for (int g = 0; g < world; ++g) gave += gave_up[g];
        ok = ok && gave == 0;
        all_ok = all_ok && ok;
        std::printf("%s %d %d %d %.2f %s\n", kNames[v], world, rows, blocks[bi],
                    *std::max_element(per_gpu.begin(), per_gpu.end()),
                    ok ? "ok" : (gave ? "FAIL(gave up waiting)" : "FAIL(rows)"));
        std::fflush(stdout);
        for (int g = 0; g < world; ++g) {
          CK(cudaSetDevice(g));
          CK(cudaMemset(r[g].recv, 0, static_cast<size_t>(world) * rows * kRowBytes));
        }
      }
    }
    for (int g = 0; g < world; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaStreamDestroy(r[g].stream));
      CK(cudaFree(r[g].src));
      CK(cudaFree(r[g].recv));
      CK(cudaFree(r[g].told));
      CK(cudaFree(r[g].state));
    }
  }
  std::printf("done\n");
  return all_ok ? 0 : 1;
}
