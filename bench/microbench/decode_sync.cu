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
// Ops are CUDA-graph nodes: graphs of R and of 2R ops are replayed alternately (a host barrier
// before each replay) and the time per op is (median of 2R - median of R) / R on the slowest GPU, so
// that the host's launch and the GPUs' start skew cancel out; "empty" is then the gap between two
// graph nodes.  Every row carries its op's number in its last word: after the timed replays a
// checking graph has each block, once its waits are over, read the number of every row it received
// (a signal seen before the rows shows as an older number), and the host compares the rows with the
// senders' (all but that word).  Prints `variant world rows_per_peer blocks us_per_op result`
// lines, then `done`; exit code 1 on any FAIL (rows not there when signalled, wrong rows, or a wait
// that gave up).
//
// Build and run (2 or more GPUs with peer access, no torch):
//   nvcc -std=c++17 -O3 -arch=sm_90 bench/microbench/decode_sync.cu -o ds && ./ds
//   options: --world 2,4  --blocks 32,64,132  --tokens 128  --variants grid,block  --graph-ops 20
//            --replays 30
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
  int rank, world, rows, variant, verify;
  const int4* src;                      // this rank's rows, [rows][kRowVecs]
  int4* dst[kMaxWorld];                 // peer p's receive buffer at this rank's slot
  unsigned long long* tell[kMaxWorld];  // peer p's flag / counter for this rank
  unsigned long long* told;             // [world]: what each peer stored or added here
  const int4* recv;                     // this rank's receive buffer, [world][rows][kRowVecs]
  unsigned long long* state;            // [0] ops finished, [1] grid arrivals, [2] blocks exited,
                                        // [3] waits given up, [4] rows older than their signal
};
constexpr int kStateWords = 8;

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
  if (*reinterpret_cast<volatile unsigned long long*>(a.state + 3) != 0) return;  // gave up once: the run FAILs
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
      if (lane == 31) v[kVecsPerLane - 1].w = static_cast<int>(op);  // the row's last word: its op
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
    if (a.verify && a.variant != kSend) {
      // thread 0's acquire, then the barrier: every thread reads after the signal (a peer may be one
      // op ahead already)
      __syncthreads();
      const int64_t received = static_cast<int64_t>(a.world - 1) * a.rows;
      for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < received; i += gridDim.x * blockDim.x) {
        const int peer = (a.rank + 1 + static_cast<int>(i / a.rows)) % a.world;
        const int4* row = a.recv + (static_cast<int64_t>(peer) * a.rows + i % a.rows) * kRowVecs;
        if (reinterpret_cast<const volatile int*>(row + kRowVecs - 1)[3] < static_cast<int>(op))
          atomicAdd(a.state + 4, 1ull);
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
  unsigned long long* told;  // [blocks][variant][world]: fresh words per (blocks, variant)
  unsigned long long* state;
};

// Comma-separated integers, each at least 1; exits on anything else.
static std::vector<int> parse_list(const char* opt, const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const long x = std::strtol(p, &end, 10);
    if (end == p || x < 1 || (*end != ',' && *end != '\0')) {
      std::fprintf(stderr, "%s: '%s' is not a list of positive integers\n", opt, s);
      std::exit(2);
    }
    v.push_back(static_cast<int>(x));
    p = *end ? end + 1 : end;
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
  bool worlds_given = false;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s needs a value\n", k.c_str());
      return 2;
    }
    if (k == "--world") worlds = parse_list(argv[i], argv[i + 1]), worlds_given = true;
    else if (k == "--blocks") blocks = parse_list(argv[i], argv[i + 1]);
    else if (k == "--tokens") tokens = parse_list(argv[i], argv[i + 1]).at(0);
    else if (k == "--graph-ops") graph_ops = parse_list(argv[i], argv[i + 1]).at(0);
    else if (k == "--replays") replays = parse_list(argv[i], argv[i + 1]).at(0);
    else if (k == "--variants") {
      variants.clear();
      for (const char* p = argv[i + 1]; *p;) {
        const char* end = std::strchr(p, ',');
        const std::string name(p, end ? end - p : std::strlen(p));
        int v = kEmpty;
        while (v <= kWarp && name != kNames[v]) ++v;
        if (v > kWarp) {
          std::fprintf(stderr, "--variants: unknown '%s' (empty, send, grid, block, warp)\n", name.c_str());
          return 2;
        }
        variants.push_back(v);
        p = end ? end + 1 : p + name.size();
      }
    } else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  if (!worlds_given && ngpu >= 4) worlds = {2, 4};
  int per_sm = 0, sms = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, op_kernel, kThreads, 0));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  bool all_ok = true;
  std::printf("variant world rows_per_peer blocks us_per_op result\n");
  for (const int world : worlds) {
    if (world < 2 || world > std::min(ngpu, kMaxWorld)) {
      std::printf("# world %d skipped: %d GPUs\n", world, ngpu);
      continue;
    }
    // remote atomics (block, warp) need them native on every pair
    bool atomics = true;
    for (int g = 0; g < world; ++g)
      for (int p = 0; p < world; ++p)
        if (p != g) {
          int native = 0;
          CK(cudaDeviceGetP2PAttribute(&native, cudaDevP2PAttrNativeAtomicSupported, g, p));
          atomics = atomics && native;
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
      CK(cudaMalloc(&x.state, sizeof(unsigned long long) * kStateWords * nv * blocks.size()));
      CK(cudaMemset(x.told, 0, sizeof(unsigned long long) * nv * world * blocks.size()));
      CK(cudaMemset(x.state, 0, sizeof(unsigned long long) * kStateWords * nv * blocks.size()));
      std::vector<uint32_t> host(static_cast<size_t>(rows) * kRowBytes / 4);
      for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint32_t>(i * 2654435761u) ^ (0x9e3779b9u * (g + 1));
      CK(cudaMemcpy(x.src, host.data(), static_cast<size_t>(rows) * kRowBytes, cudaMemcpyHostToDevice));
      CK(cudaMemset(x.recv, 0, static_cast<size_t>(world) * rows * kRowBytes));
      CK(cudaDeviceSynchronize());  // the memsets (legacy stream) before any op on the op streams
    }
    for (size_t bi = 0; bi < blocks.size(); ++bi) {
      if (blocks[bi] > per_sm * sms) {  // a block would wait for blocks that cannot be resident
        std::printf("# blocks %d skipped: at most %d resident\n", blocks[bi], per_sm * sms);
        continue;
      }
      for (const int v : variants) {
        if ((v == kBlock || v == kWarp) && !atomics) {
          std::printf("# %s skipped at world %d: no native peer atomics\n", kNames[v], world);
          continue;
        }
        const size_t slot = bi * nv + v;  // fresh words: counts start at 0 for every (blocks, variant)
        std::vector<double> per_gpu(world, 0.0);
        std::vector<unsigned long long> gave_up(world, 0), stale(world, 0);
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
            a.recv = x.recv;
            a.state = x.state + slot * kStateWords;
            // graphs of R and 2R timed ops, and R checking ops; one op numbering runs through all
            cudaGraphExec_t exec[3];
            for (int k = 0; k < 3; ++k) {
              a.verify = k == 2;
              cudaGraph_t graph;
              CK(cudaStreamBeginCapture(x.stream, cudaStreamCaptureModeThreadLocal));
              for (int i = 0; i < (k == 1 ? 2 : 1) * graph_ops; ++i) op_kernel<<<blocks[bi], kThreads, 0, x.stream>>>(a);
              CK(cudaStreamEndCapture(x.stream, &graph));
              CK(cudaGraphInstantiate(&exec[k], graph, 0));
              CK(cudaGraphDestroy(graph));
            }
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            auto replay = [&](int k) {
              barrier.wait();
              CK(cudaEventRecord(e0, x.stream));
              CK(cudaGraphLaunch(exec[k], x.stream));
              CK(cudaEventRecord(e1, x.stream));
              CK(cudaEventSynchronize(e1));
              float t = 0.f;
              CK(cudaEventElapsedTime(&t, e0, e1));
              return 1000.0 * t;
            };
            for (int rep = 0; rep < 3; ++rep) replay(0);  // warm-up
            std::vector<double> us[2];
            for (int rep = 0; rep < replays; ++rep)
              for (int k = 0; k < 2; ++k) us[k].push_back(replay(k));
            for (int rep = 0; rep < 2; ++rep) replay(2);
            for (auto& u : us) std::sort(u.begin(), u.end());
            per_gpu[g] = (us[1][us[1].size() / 2] - us[0][us[0].size() / 2]) / graph_ops;
            unsigned long long st[kStateWords];
            CK(cudaMemcpy(st, a.state, sizeof(st), cudaMemcpyDeviceToHost));
            gave_up[g] = st[3];
            stale[g] = st[4];
            for (auto& e : exec) CK(cudaGraphExecDestroy(e));
            CK(cudaEventDestroy(e0));
            CK(cudaEventDestroy(e1));
          });
        for (auto& t : threads) t.join();
        // the rows each rank received from each peer are that peer's rows (but the op number word)
        bool rows_ok = true;
        if (v != kEmpty) {
          const size_t n = static_cast<size_t>(rows) * kRowBytes;
          std::vector<uint8_t> want(n), got(n);
          for (int g = 0; g < world && rows_ok; ++g)
            for (int p = 0; p < world && rows_ok; ++p) {
              if (p == g) continue;
              CK(cudaSetDevice(p));
              CK(cudaMemcpy(want.data(), r[p].src, n, cudaMemcpyDeviceToHost));
              CK(cudaSetDevice(g));
              CK(cudaMemcpy(got.data(), r[g].recv + static_cast<size_t>(p) * rows * kRowVecs, n, cudaMemcpyDeviceToHost));
              for (int row = 0; row < rows && rows_ok; ++row)
                rows_ok = std::memcmp(want.data() + static_cast<size_t>(row) * kRowBytes,
                                      got.data() + static_cast<size_t>(row) * kRowBytes, kRowBytes - 4) == 0;
            }
        }
        unsigned long long gave = 0, old_rows = 0;
        for (int g = 0; g < world; ++g) {
          gave += gave_up[g];
          old_rows += stale[g];
        }
        const bool ok = rows_ok && gave == 0 && old_rows == 0;
        all_ok = all_ok && ok;
        const std::string why = gave ? "FAIL(gave up waiting)" : old_rows ? "FAIL(rows older than their signal)"
                                                                          : "FAIL(wrong rows)";
        std::printf("%s %d %d %d %.2f %s\n", kNames[v], world, rows, blocks[bi],
                    *std::max_element(per_gpu.begin(), per_gpu.end()), ok ? "ok" : why.c_str());
        std::fflush(stdout);
        for (int g = 0; g < world; ++g) {
          CK(cudaSetDevice(g));
          CK(cudaMemset(r[g].recv, 0, static_cast<size_t>(world) * rows * kRowBytes));
          CK(cudaDeviceSynchronize());
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
