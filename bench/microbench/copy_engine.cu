// Can the copy engines carry a prefill dispatch's rows between GPUs while the SMs only lay them out?
//
// The copied standard dispatch at 4096 tokens is bound by its sends: 24 SMs push rows to the peers at
// about 340 GB/s (send_copy.cu), and the layout of the received rows shares those SMs
// (docs/performance.md).  A copy engine moves bytes without SMs.  Here every GPU sends `rows` rows of
// 14,336 bytes to every other GPU at once (an all-to-all, as a dispatch does), and the program times,
// per GPU (CUDA events from a common start, max over GPUs, median over `reps`):
//
//   sm        a kernel of `blocks` blocks of 512 threads stores every row to every peer (16-byte warp
//             stores, 4 loads in flight per lane: the kernels' send-side copy)
//   ce        one cudaMemcpyPeerAsync per peer, each on a stream of its own
//   copy      a kernel of `blocks` blocks copies as many rows as a GPU receives (rows x peers) from a
//             local buffer into an output (the standard layout's copy out of the receive buffer)
//   ce+copy   both at once, independent: do the local copy and the copy engines slow each other?
//   pipe C    the dispatch's shape: each peer's rows go in C chunks by the copy engine, each followed
//             in its stream by a flag written into the receiver (cuStreamWriteValue32, ordered after
//             the chunk's bytes); the receiver's copy kernel waits for a chunk's flag and copies its
//             rows out as the chunks land
//   pipek C   the same with each chunk's flag written by a one-thread kernel in the chunk's stream
//             (st.release.sys) instead of the stream memory operation
//
// For the pipe modes the program also prints, for GPU 0, when its copy kernel first saw each source's
// chunk flag (µs from the copy kernel's start, last repetition): whether chunks land as they are sent
// or all at the end.
//
// `--vmm 1`: the receive buffers and flags are cuMem allocations mapped for every GPU (cuMemCreate,
// cuMemMap, cuMemSetAccess), as the library's buffers are, instead of cudaMalloc with peer access.
// `--pitch P` (bytes, a multiple of 16, at least 14,336): received rows sit P bytes apart, as a
// dispatch's rows do behind their headers; the copy engines then move them with cudaMemcpy2DAsync.
//
// All GPUs start together: each GPU's work is queued behind a kernel that waits for a flag in mapped
// host memory, which the host sets once everything is queued.  The pipe's waits give up after a second
// (`timed out`: a flag that never came).  A receiver holds its peers' rows as one [peers][rows] array:
// source s at index (s - receiver - 1) mod GPUs.  The received rows and the copied
// outputs are checked byte for byte after every mode (`check ...`); exit code 1 on a difference.
//
// Build and run (2 or more GPUs, no torch):
//   nvcc -std=c++17 -O3 -arch=sm_90 bench/microbench/copy_engine.cu -lcuda -o cpe && ./cpe
//   options: --rows 4096 --blocks 24 --chunks 1,4,8,16 --reps 20 --pitch 14336 --vmm 0
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "check.cuh"

#define CU(x)                                                                             \
  do {                                                                                    \
    CUresult r_ = (x);                                                                    \
    if (r_ != CUDA_SUCCESS) {                                                             \
      const char* s_ = nullptr;                                                           \
      cuGetErrorString(r_, &s_);                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_ ? s_ : "?");     \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kRowBytes = 14336;
constexpr int kMaxGpus = 8;
constexpr int kMaxChunks = 64;

__global__ void wait_host(const volatile int* go) {
  while (*go == 0) {
  }
}

// Every row of `src` to each of `npeers` destinations (the same row index there)
__global__ void __launch_bounds__(kThreads, 1) sm_send(const uint8_t* src, uint8_t* const* dst, int npeers, int rows,
                                                       int64_t pitch) {
  constexpr int n = kRowBytes / 16, kUnroll = 4;
  const int lane = threadIdx.x & 31, gw = (blockIdx.x * kThreads + threadIdx.x) >> 5, nw = gridDim.x * kWarps;
  for (int r = gw; r < rows; r += nw) {
    const int4* s = reinterpret_cast<const int4*>(src + static_cast<int64_t>(r) * kRowBytes);
    for (int i = lane; i < n; i += kUnroll * 32) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + u * 32 < n) v[u] = s[i + u * 32];
      for (int d = 0; d < npeers; ++d) {
        int4* o = reinterpret_cast<int4*>(dst[d] + r * pitch);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i + u * 32 < n) o[i + u * 32] = v[u];
      }
    }
  }
}

// chunk c of the stream's rows landed in the receiver: its flag, released at system scope
__global__ void set_flag(int* flag, int value) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The received rows [sources][rows] (`pitch` bytes apart) into `out` (compact), chunk-major (chunk c of every source, then c + 1):
// with `flags` (pipe), a row is copied once its source's flag for that chunk reads `epoch`; a flag
// not seen within a second sets *timed_out and the warp stops
__global__ void __launch_bounds__(kThreads, 1) copy_out(const uint8_t* recv, uint8_t* out, int sources, int rows,
                                                        int chunks, const int* flags, int epoch, int* timed_out,
                                                        int64_t pitch, unsigned long long* seen) {
  const int lane = threadIdx.x & 31, gw = (blockIdx.x * kThreads + threadIdx.x) >> 5, nw = gridDim.x * kWarps;
  const int per_chunk = (rows + chunks - 1) / chunks;
  const int64_t items = static_cast<int64_t>(chunks) * sources * per_chunk;  // the last chunk may be short
  if (threadIdx.x == 0) atomicMin(seen + kMaxGpus * kMaxChunks, now_ns());  // the kernel's start
  int seen_flag = -1;  // the flag (source * chunks + chunk) this warp last saw set
  for (int64_t i = gw; i < items; i += nw) {
    // chunk-major order: rows of chunk c of every source before chunk c + 1
    const int c = static_cast<int>(i / (static_cast<int64_t>(sources) * per_chunk));
    const int64_t in_chunk = i - static_cast<int64_t>(c) * sources * per_chunk;
    const int src = static_cast<int>(in_chunk / per_chunk);
    const int r = c * per_chunk + static_cast<int>(in_chunk % per_chunk);
    if (r >= rows) continue;
    if (flags != nullptr && seen_flag != src * chunks + c) {
      int late = 0;
      if (lane == 0) {
        const unsigned long long deadline = now_ns() + 1000000000ull;
        while (ld_acquire_sys(flags + src * kMaxChunks + c) != epoch)
          if (now_ns() > deadline) {
            atomicExch(timed_out, 1);
            late = 1;
            break;
          }
      }
      if (lane == 0 && !late) atomicMin(seen + src * kMaxChunks + c, now_ns());
      if (__shfl_sync(0xffffffffu, late, 0)) return;
      seen_flag = src * chunks + c;
    }
    const int64_t row = static_cast<int64_t>(src) * rows + r;
    warp_copy_row(recv + row * pitch, out + row * kRowBytes, kRowBytes, lane);
  }
}

struct Gpu {
  uint8_t* x;                  // [rows][kRowBytes]: what this GPU sends
  uint8_t* recv;               // [peers][rows][pitch]: what the peers sent (index_at)
  uint8_t* held;               // [peers][rows][pitch]: the peers' rows, written once: copy's source
  uint8_t* out;                // [peers][rows][kRowBytes]: received rows copied out
  int* flags;                  // [peers][kMaxChunks]: the peer's chunk c landed (pipe)
  int* timed_out;              // a pipe wait gave up
  unsigned long long* seen;    // [kMaxGpus][kMaxChunks] + 1: when a chunk's flag was first seen, the copy's start
  uint8_t** dst;               // device [ngpu - 1]: this GPU's slot in each peer's recv
  cudaStream_t main, side, peer[kMaxGpus];
  cudaEvent_t t0, t1, forked, done[kMaxGpus], side_done;
};

struct Setup {
  int ngpu, rows, blocks;
  int64_t pitch;  // bytes between received rows
  std::vector<Gpu> g;
  volatile int* go;  // mapped host memory
  int* go_dev;
};

// the i-th peer of GPU g (every other GPU, in order g + 1, g + 2, ...)
static int peer_of(int ngpu, int g, int i) { return (g + 1 + i) % ngpu; }

// `bytes` on GPU `dev` (rounded up to the allocation granularity), mapped read-write for GPUs [0, ngpu)
static void* vmm_alloc(int dev, size_t bytes, int ngpu) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  size_t gran = 0;
  CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  bytes = (bytes + gran - 1) / gran * gran;
  CUdeviceptr va = 0;
  CU(cuMemAddressReserve(&va, bytes, gran, 0, 0));
  CUmemGenericAllocationHandle h;
  CU(cuMemCreate(&h, bytes, &prop, 0));
  CU(cuMemMap(va, bytes, 0, h, 0));
  std::vector<CUmemAccessDesc> access(ngpu);
  for (int g = 0; g < ngpu; ++g) {
    access[g].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[g].location.id = g;
    access[g].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CU(cuMemSetAccess(va, bytes, access.data(), ngpu));
  return reinterpret_cast<void*>(va);
}

// where a receiver keeps a source's rows and flags
static int index_at(int ngpu, int receiver, int source) { return (source - receiver - 1 + ngpu) % ngpu; }

enum Mode { kSm, kCe, kCopy, kCeCopy, kPipe, kPipeKernel };

static float run_once(Setup& S, Mode mode, int chunks, int epoch) {
  const size_t recv_set = static_cast<size_t>(S.rows) * S.pitch;
  const int peers = S.ngpu - 1;
  *S.go = 0;
  for (int g = 0; g < S.ngpu; ++g) {
    Gpu& G = S.g[g];
    CK(cudaSetDevice(g));
    wait_host<<<1, 1, 0, G.main>>>(S.go_dev);
    CK(cudaGetLastError());
    CK(cudaEventRecord(G.t0, G.main));
    CK(cudaEventRecord(G.forked, G.main));
    if (mode == kSm) {
      sm_send<<<S.blocks, kThreads, 0, G.main>>>(G.x, G.dst, peers, S.rows, S.pitch);
      CK(cudaGetLastError());
    }
    const bool pipe = mode == kPipe || mode == kPipeKernel;
    if (mode == kCe || mode == kCeCopy || pipe) {
      const int per_chunk = (S.rows + chunks - 1) / chunks;
      for (int i = 0; i < peers; ++i) {
        const int d = peer_of(S.ngpu, g, i);
        CK(cudaStreamWaitEvent(G.peer[i], G.forked, 0));
        uint8_t* slot = S.g[d].recv + static_cast<size_t>(index_at(S.ngpu, d, g)) * recv_set;
        const int cs = pipe ? chunks : 1;
        for (int c = 0; c < cs; ++c) {
          const int r0 = c * (pipe ? per_chunk : S.rows);
          const int r1 = std::min(S.rows, r0 + (pipe ? per_chunk : S.rows));
          if (r1 <= r0) continue;
          if (S.pitch == kRowBytes) {
            const size_t off = static_cast<size_t>(r0) * kRowBytes, bytes = static_cast<size_t>(r1 - r0) * kRowBytes;
            CK(cudaMemcpyPeerAsync(slot + off, d, G.x + off, g, bytes, G.peer[i]));
          } else {
            CK(cudaMemcpy2DAsync(slot + r0 * S.pitch, S.pitch, G.x + static_cast<size_t>(r0) * kRowBytes, kRowBytes,
                                 kRowBytes, r1 - r0, cudaMemcpyDefault, G.peer[i]));
          }
          int* flag = S.g[d].flags + index_at(S.ngpu, d, g) * kMaxChunks + c;
          if (mode == kPipeKernel) {
            set_flag<<<1, 1, 0, G.peer[i]>>>(flag, epoch);
            CK(cudaGetLastError());
          }
          if (mode == kPipe) {
            CU(cuStreamWriteValue32(reinterpret_cast<CUstream>(G.peer[i]), reinterpret_cast<CUdeviceptr>(flag),
                                    static_cast<cuuint32_t>(epoch), CU_STREAM_WRITE_VALUE_DEFAULT));
          }
        }
        CK(cudaEventRecord(G.done[i], G.peer[i]));
      }
    }
    if (mode == kCopy || mode == kCeCopy || pipe) {
      CK(cudaStreamWaitEvent(G.side, G.forked, 0));
      CK(cudaMemsetAsync(G.seen, 0xff, sizeof(unsigned long long) * (kMaxGpus * kMaxChunks + 1), G.side));
      copy_out<<<S.blocks, kThreads, 0, G.side>>>(pipe ? G.recv : G.held, G.out, peers, S.rows, pipe ? chunks : 1,
                                                  pipe ? G.flags : nullptr, epoch, G.timed_out, S.pitch, G.seen);
      CK(cudaGetLastError());
      CK(cudaEventRecord(G.side_done, G.side));
      CK(cudaStreamWaitEvent(G.main, G.side_done, 0));
    }
    if (mode == kCe || mode == kCeCopy || pipe)
      for (int i = 0; i < peers; ++i) CK(cudaStreamWaitEvent(G.main, G.done[i], 0));
    CK(cudaEventRecord(G.t1, G.main));
  }
  *S.go = 1;
  float worst = 0.f;
  for (int g = 0; g < S.ngpu; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaEventSynchronize(S.g[g].t1));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, S.g[g].t0, S.g[g].t1));
    worst = std::max(worst, ms * 1e3f);
  }
  return worst;
}

// The rows each GPU received (sm, ce, ce+copy, pipe) and copied out (copy, ce+copy, pipe), against
// their sources; false too where a pipe wait timed out
static bool check(Setup& S, Mode mode, const std::vector<std::vector<uint8_t>>& xs) {
  const size_t row_set = static_cast<size_t>(S.rows) * kRowBytes;
  std::vector<uint8_t> h(row_set);
  for (int g = 0; g < S.ngpu; ++g) {
    CK(cudaSetDevice(g));
    int late = 0;
    CK(cudaMemcpy(&late, S.g[g].timed_out, sizeof(int), cudaMemcpyDeviceToHost));
    if (late) {
      std::printf("GPU %d: a chunk's flag never came (timed out)\n", g);
      return false;
    }
    for (int i = 0; i < S.ngpu - 1; ++i) {
      const int src = peer_of(S.ngpu, g, i);  // index_at(g, src) == i
      if (mode != kCopy) {
        CK(cudaMemcpy2D(h.data(), kRowBytes, S.g[g].recv + static_cast<size_t>(i) * S.rows * S.pitch, S.pitch,
                        kRowBytes, S.rows, cudaMemcpyDeviceToHost));
        if (h != xs[src]) return false;
      }
      if (mode != kSm && mode != kCe) {
        CK(cudaMemcpy(h.data(), S.g[g].out + static_cast<size_t>(i) * row_set, row_set, cudaMemcpyDeviceToHost));
        if (h != xs[src]) return false;
      }
    }
  }
  return true;
}

int main(int argc, char** argv) {
  int rows = 4096, blocks = 24, reps = 20;
  int64_t pitch = kRowBytes;
  bool vmm = false;
  std::string chunk_list = "1,4,8,16";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--rows") rows = std::atoi(v.c_str());
    else if (k == "--blocks") blocks = std::atoi(v.c_str());
    else if (k == "--reps") reps = std::atoi(v.c_str());
    else if (k == "--chunks") chunk_list = v;
    else if (k == "--pitch") pitch = std::atoll(v.c_str());
    else if (k == "--vmm") vmm = std::atoi(v.c_str()) != 0;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  CU(cuInit(0));
  Setup S{};
  CK(cudaGetDeviceCount(&S.ngpu));
  S.ngpu = std::min(S.ngpu, kMaxGpus);
  if (S.ngpu < 2 || rows < 1 || blocks < 1 || reps < 1 || pitch < kRowBytes || pitch % 16) {
    std::fprintf(stderr, "needs 2 GPUs or more, positive --rows, --blocks, --reps, --pitch >= %d in 16s\n", kRowBytes);
    return 2;
  }
  S.rows = rows;
  S.blocks = blocks;
  S.pitch = pitch;
  const int peers = S.ngpu - 1;
  const size_t row_set = static_cast<size_t>(rows) * kRowBytes;
  int* go_host = nullptr;
  CK(cudaHostAlloc(&go_host, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));
  S.go = go_host;
  CK(cudaHostGetDevicePointer(&S.go_dev, go_host, 0));
  std::vector<std::vector<uint8_t>> xs(S.ngpu, std::vector<uint8_t>(row_set));
  S.g.resize(S.ngpu);
  for (int g = 0; g < S.ngpu; ++g) {
    for (size_t i = 0; i < row_set; ++i) xs[g][i] = static_cast<uint8_t>(((i + 977u * g) * 2654435761u) >> 13);
    Gpu& G = S.g[g];
    CK(cudaSetDevice(g));
    for (int d = 0; d < S.ngpu; ++d) {
      if (d == g) continue;
      int can = 0;
      CK(cudaDeviceCanAccessPeer(&can, g, d));
      if (!can) {
        std::fprintf(stderr, "GPU %d cannot map GPU %d\n", g, d);
        return 2;
      }
      CK(cudaDeviceEnablePeerAccess(d, 0));
    }
    CK(cudaMalloc(&G.x, row_set));
    CK(cudaMemcpy(G.x, xs[g].data(), row_set, cudaMemcpyHostToDevice));
    if (vmm) G.recv = static_cast<uint8_t*>(vmm_alloc(g, static_cast<size_t>(rows) * pitch * peers, S.ngpu));
    else CK(cudaMalloc(&G.recv, static_cast<size_t>(rows) * pitch * peers));
    CK(cudaMalloc(&G.held, static_cast<size_t>(rows) * pitch * peers));
    CK(cudaMalloc(&G.out, row_set * peers));
    if (vmm) G.flags = static_cast<int*>(vmm_alloc(g, sizeof(int) * peers * kMaxChunks, S.ngpu));
    else CK(cudaMalloc(&G.flags, sizeof(int) * peers * kMaxChunks));
    CK(cudaMemset(G.flags, 0, sizeof(int) * peers * kMaxChunks));
    CK(cudaMalloc(&G.timed_out, sizeof(int)));
    CK(cudaMemset(G.timed_out, 0, sizeof(int)));
    CK(cudaMalloc(&G.seen, sizeof(unsigned long long) * (kMaxGpus * kMaxChunks + 1)));
    CK(cudaMalloc(&G.dst, sizeof(uint8_t*) * peers));
    CK(cudaStreamCreateWithFlags(&G.main, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&G.side, cudaStreamNonBlocking));
    for (int i = 0; i < peers; ++i) CK(cudaStreamCreateWithFlags(&G.peer[i], cudaStreamNonBlocking));
    CK(cudaEventCreate(&G.t0));
    CK(cudaEventCreate(&G.t1));
    CK(cudaEventCreateWithFlags(&G.forked, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&G.side_done, cudaEventDisableTiming));
    for (int i = 0; i < peers; ++i) CK(cudaEventCreateWithFlags(&G.done[i], cudaEventDisableTiming));
  }
  for (int g = 0; g < S.ngpu; ++g) {  // the SM kernel's destinations: this GPU's slot in each peer's recv
    std::vector<uint8_t*> dst(peers);
    for (int i = 0; i < peers; ++i) {
      const int d = peer_of(S.ngpu, g, i);
      dst[i] = S.g[d].recv + static_cast<size_t>(index_at(S.ngpu, d, g)) * rows * pitch;
    }
    CK(cudaSetDevice(g));
    CK(cudaMemcpy(S.g[g].dst, dst.data(), sizeof(uint8_t*) * peers, cudaMemcpyHostToDevice));
  }
  // what the copy reads in copy and ce+copy: the rows as received
  for (int g = 0; g < S.ngpu; ++g)
    for (int i = 0; i < peers; ++i) {
      CK(cudaSetDevice(g));
      CK(cudaMemcpy2D(S.g[g].held + static_cast<size_t>(i) * rows * pitch, pitch, xs[peer_of(S.ngpu, g, i)].data(),
                      kRowBytes, kRowBytes, rows, cudaMemcpyHostToDevice));
    }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double sent_mb = static_cast<double>(row_set) * peers / 1e6;
  std::printf("device %s x %d; every GPU sends %d rows of %d B to each of its %d peers (%.1f MB out, %.1f MB in),"
              " received %lld B apart in %s; kernels on %d blocks; µs from a common start, max over GPUs, median of %d\n",
              prop.name, S.ngpu, rows, kRowBytes, peers, sent_mb, sent_mb, static_cast<long long>(pitch),
              vmm ? "cuMem mappings" : "cudaMalloc", blocks, reps);
  std::printf("%-8s %6s %9s %9s %12s\n", "mode", "chunks", "p50_us", "min_us", "GB/s out/GPU");
  struct Case {
    const char* name;
    Mode mode;
    int chunks;
  };
  std::vector<Case> cases = {{"sm", kSm, 1}, {"ce", kCe, 1}, {"copy", kCopy, 1}, {"ce+copy", kCeCopy, 1}};
  for (const std::string& c : comma_list(chunk_list)) {
    const int n = std::atoi(c.c_str());
    if (n >= 1 && n <= kMaxChunks) {
      cases.push_back({"pipe", kPipe, n});
      cases.push_back({"pipek", kPipeKernel, n});
    }
  }
  bool all_ok = true;
  int epoch = 0;
  for (const Case& c : cases) {
    for (int g = 0; g < S.ngpu; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaMemset(S.g[g].recv, 0, static_cast<size_t>(rows) * pitch * peers));
      CK(cudaMemset(S.g[g].out, 0, row_set * peers));
      CK(cudaDeviceSynchronize());
    }
    std::vector<float> t;
    for (int i = 0; i < reps + 3; ++i) {
      const float us = run_once(S, c.mode, c.chunks, ++epoch);
      if (i >= 3) t.push_back(us);
    }
    std::sort(t.begin(), t.end());
    const bool ok = check(S, c.mode, xs);
    all_ok = all_ok && ok;
    const float p50 = t[t.size() / 2];
    std::printf("%-8s %6d %9.1f %9.1f %12.0f%s\n", c.name, c.chunks, p50, t.front(),
                c.mode == kCopy ? 0.0 : sent_mb * 1e6 / (p50 * 1e-6) / 1e9, ok ? "" : "  MISMATCH");
    if (c.mode == kPipe || c.mode == kPipeKernel) {  // GPU 0's last repetition: when each chunk was seen
      std::vector<unsigned long long> seen(kMaxGpus * kMaxChunks + 1);
      CK(cudaSetDevice(0));
      CK(cudaMemcpy(seen.data(), S.g[0].seen, sizeof(unsigned long long) * seen.size(), cudaMemcpyDeviceToHost));
      const unsigned long long start = seen[kMaxGpus * kMaxChunks];
      for (int i = 0; i < peers; ++i) {
        std::printf("  GPU 0, source %d, chunk seen at (µs from the copy's start):", peer_of(S.ngpu, 0, i));
        for (int k = 0; k < c.chunks; ++k)
          std::printf(" %.1f", (static_cast<double>(seen[i * kMaxChunks + k]) - static_cast<double>(start)) * 1e-3);
        std::printf("\n");
      }
    }
  }
  std::printf("check %s\ndone\n", all_ok ? "identical" : "DIFFERENT");
  return all_ok ? 0 : 1;
}
