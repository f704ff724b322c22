// Can a prefill dispatch lay received rows out while it still quantises its own?
//
// At EP2 the quantised dispatch's sends are bound by instructions and the receive copy after them by
// memory (docs/performance.md); one after the other on 24 SMs they add up.  This program exchanges
// 4096 fp8 rows each way between two GPUs, as the dispatch would if each row carried its own arrival
// marker, and times the exchange on both GPUs at once:
//
//   send_only     every warp quantises rows to the peer's receive region and to a local row (the
//                 dispatch's sends), no marker: what the sends cost alone
//   send_marked   the same, each warp raising a system-scope fence after every --fence-every rows and
//                 then writing those rows' markers: what the markers cost the sends
//   seq           the dispatch's order: every warp sends (unmarked), a grid-wide arrival, one flag to
//                 the peer, then every warp copies the peer's rows into --slots places each
//   overlap       the first --send-warps warps of every block send marked rows; the others copy each
//                 peer row into its --slots places as soon as its marker is seen
//
// A row is a 16-byte header (the marker: the launch's code in its first 8 bytes), 7168 fp8 codes and
// 56 float scales, quantised by the library's warp_quant_fp8_multi (csrc/common/quantise.cuh) from
// 7168 bf16 channels.  Each GPU's kernel starts after a handshake with the other; its time is from
// the first block's start to the last block's end (the GPU's global timer), and a run's time is the
// slower GPU's.  Prints `mode send_warps fence_every slots p50_us min_us` per configuration, then
// `check ...` (every laid-out row of seq and overlap against the row the peer kept locally, byte for
// byte) and `done`; exit code 1 on a difference or a timeout.
//
// Build and run (2 GPUs, no torch; csrc/common/protocol_table.h comes from the library's build,
// `python3 -m pip install --no-build-isolation --no-deps -e .`):
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc bench/microbench/overlap_recv.cu -o ov && ./ov
//   options: --blocks 24 --send-warps 10,12,14 --fence-every 1,4 --slots 1,4 --reps 20
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "check.cuh"
#include "common/quantise.cuh"

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kHidden = 7168;
constexpr int kTokens = 4096;
constexpr int64_t kHeader = 16;
constexpr int64_t kOutRow = kHidden + kHidden / 128 * 4;  // codes, then float scales
constexpr int64_t kRow = kHeader + kOutRow;
constexpr int kMaxSlots = 4;
constexpr int kMaxFenceEvery = 8;
constexpr uint64_t kTimeoutNs = 5000000000ull;  // long enough for a first launch that loads its module

enum Mode { kSendOnly, kSendMarked, kSeq, kOverlap, kModes };
const char* const kModeNames[kModes] = {"send_only", "send_marked", "seq", "overlap"};

struct Side {                   // one GPU's view of the exchange
  const __nv_bfloat16* x;       // [tokens][hidden], local
  uint8_t* peer_rows;           // the peer's receive region [tokens][kRow] (remote)
  uint8_t* rows;                // this GPU's receive region [tokens][kRow], written by the peer
  uint8_t* own;                 // [tokens][kOutRow]: the rows as sent, kept locally
  uint8_t* out;                 // [kMaxSlots][tokens][kOutRow]: received rows laid out
  uint64_t* peer_flags;         // the peer's flag words (remote): [0] sends done, [1] ready
  uint64_t* flags;              // this GPU's flag words, written by the peer
  unsigned long long* arrived;  // grid arrival counter (monotonic over launches)
  unsigned long long* go;       // block 0 releases the other blocks after the handshake
  uint64_t* stamps;             // [blocks][2]: start, end
  int* timeouts;                // waits that gave up
  int send_warps;               // overlap: warps of a block that send
  int fence_every;              // send_marked, overlap: rows a sending warp marks per fence
  int slots;                    // places each received row goes to (1: standard layout; 4: batched)
  uint64_t code;                // this launch's code: markers and flags carry it
};

__device__ __forceinline__ bool wait_u64(const uint64_t* p, uint64_t want, uint64_t deadline, int* timeouts) {
  uint32_t spins = 0;
  while (ep_comm::ld_acquire_sys(p) != want) {
    if ((++spins & 255u) == 0 && ep_comm::global_timer_ns() > deadline) {
      atomicAdd(timeouts, 1);
      return false;
    }
  }
  return true;
}

// One warp sends rows first, first + step, ...: codes and scales to the peer's region and to the local
// copy.  kMarked: after every fence_every rows (and the last), a system-scope fence orders the rows'
// bytes before their markers, which lane 0 then writes.
template <bool kMarked>
__device__ void send_rows(const Side& s, int first, int step, uint8_t* stage, uint8_t** dst, float** scl, int lane) {
  int pending = 0;  // rows sent since the last fence: t, t - step, ...
  for (int t = first; t < kTokens; t += step) {
    if (lane == 0) {
      dst[0] = s.peer_rows + static_cast<int64_t>(t) * kRow + kHeader;
      dst[1] = s.own + static_cast<int64_t>(t) * kOutRow;
      scl[0] = reinterpret_cast<float*>(dst[0] + kHidden);
      scl[1] = reinterpret_cast<float*>(dst[1] + kHidden);
    }
    __syncwarp();
    ep_comm::warp_quant_fp8_multi<__nv_bfloat16>(s.x + static_cast<int64_t>(t) * kHidden, kHidden, dst, scl, 2,
                                                 lane, stage);
    __syncwarp();
    if (!kMarked) continue;
    if (++pending == s.fence_every || t + step >= kTokens) {
      __threadfence_system();
      if (lane == 0)
        for (int i = 0; i < pending; ++i)
          *reinterpret_cast<volatile uint64_t*>(s.peer_rows + static_cast<int64_t>(t - i * step) * kRow) = s.code;
      pending = 0;
    }
  }
}

// One warp lays out the peer's rows first, first + step, ... into their slots, each once its marker
// carries this launch's code.
__device__ void receive_rows(const Side& s, int first, int step, uint8_t** dst, uint64_t deadline, int lane) {
  for (int t = first; t < kTokens; t += step) {
    const uint8_t* row = s.rows + static_cast<int64_t>(t) * kRow;
    bool ok = true;
    if (lane == 0) {
      ok = wait_u64(reinterpret_cast<const uint64_t*>(row), s.code, deadline, s.timeouts);
      for (int k = 0; k < s.slots; ++k) dst[k] = s.out + (static_cast<int64_t>(k) * kTokens + t) * kOutRow;
    }
    if (!__shfl_sync(0xffffffffu, ok, 0)) return;
    __syncwarp();
    ep_comm::warp_copy_multi<true>(row + kHeader, dst, s.slots, kOutRow, lane);
    __syncwarp();
  }
}

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) exchange(Side s) {
  __shared__ __align__(16) uint8_t s_stage[kWarps][ep_comm::kQuantStageBytes];
  __shared__ uint8_t* s_dst[kWarps][kMaxSlots];
  __shared__ float* s_scl[kWarps][2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint64_t deadline = ep_comm::global_timer_ns() + kTimeoutNs;
  // both GPUs start together: block 0 meets the peer, then lets the other blocks go
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) {
      ep_comm::st_release_sys(s.peer_flags + 1, s.code);
      wait_u64(s.flags + 1, s.code, deadline, s.timeouts);
      atomicExch(s.go, s.code);
    } else {
      while (ep_comm::ld_acquire_gpu(s.go) != s.code && ep_comm::global_timer_ns() < deadline) {
      }
    }
    s.stamps[2 * blockIdx.x] = ep_comm::global_timer_ns();
  }
  __syncthreads();
  uint8_t** dst = s_dst[warp];
  if (kMode == kOverlap) {
    const int ns = s.send_warps, nr = kWarps - s.send_warps;
    if (warp < ns) send_rows<true>(s, blockIdx.x * ns + warp, gridDim.x * ns, s_stage[warp], dst, s_scl[warp], lane);
    else receive_rows(s, blockIdx.x * nr + warp - ns, gridDim.x * nr, dst, deadline, lane);
  } else {
    const int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
    send_rows<kMode == kSendMarked>(s, gwarp, nwarps, s_stage[warp], dst, s_scl[warp], lane);
    if (kMode == kSeq) {
      // the rows' markers, then every block's arrival; the last block to arrive signals the peer
      if (lane == 0)
        for (int t = gwarp; t < kTokens; t += nwarps)
          *reinterpret_cast<volatile uint64_t*>(s.peer_rows + static_cast<int64_t>(t) * kRow) = s.code;
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence_system();
        const unsigned long long before = atomicAdd(s.arrived, 1ull);
        if ((before + 1) % gridDim.x == 0) ep_comm::st_release_sys(s.peer_flags, s.code);
        wait_u64(s.flags, s.code, deadline, s.timeouts);
      }
      __syncthreads();
      receive_rows(s, gwarp, nwarps, dst, deadline, lane);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) s.stamps[2 * blockIdx.x + 1] = ep_comm::global_timer_ns();
}

template <int kMode>
void launch(const Side& s, int blocks, cudaStream_t stream) {
  exchange<kMode><<<blocks, kThreads, 0, stream>>>(s);
}

void launch_mode(int mode, const Side& s, int blocks, cudaStream_t stream) {
  switch (mode) {
    case kSendOnly: launch<kSendOnly>(s, blocks, stream); break;
    case kSendMarked: launch<kSendMarked>(s, blocks, stream); break;
    case kSeq: launch<kSeq>(s, blocks, stream); break;
    default: launch<kOverlap>(s, blocks, stream); break;
  }
  CK(cudaGetLastError());
}

struct Config {
  int mode, send_warps, fence_every, slots;
};

int main(int argc, char** argv) {
  int blocks = 24, reps = 20;
  std::vector<int> send_warps = {10, 12, 14}, fence_every = {1, 4}, slots = {1, 4};
  for (int i = 1; i + 1 < argc; i += 2) {
    auto ints = [&](std::vector<int>& v) {
      v.clear();
      for (const auto& x : comma_list(argv[i + 1])) v.push_back(std::stoi(x));
    };
    if (!std::strcmp(argv[i], "--blocks")) blocks = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--reps")) reps = std::stoi(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--send-warps")) ints(send_warps);
    else if (!std::strcmp(argv[i], "--fence-every")) ints(fence_every);
    else if (!std::strcmp(argv[i], "--slots")) ints(slots);
  }
  for (int& f : fence_every) f = std::min(std::max(f, 1), kMaxFenceEvery);
  for (int& k : slots) k = std::min(std::max(k, 1), kMaxSlots);
  for (int& w : send_warps) w = std::min(std::max(w, 1), kWarps - 1);
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  if (ngpu < 2) {
    std::fprintf(stderr, "needs 2 GPUs (found %d)\n", ngpu);
    return 1;
  }
  Side side[2]{};
  cudaStream_t stream[2];
  int* timeouts[2];
  for (int g = 0; g < 2; ++g) {
    CK(cudaSetDevice(g));
    int can = 0;
    CK(cudaDeviceCanAccessPeer(&can, g, 1 - g));
    if (!can) {
      std::fprintf(stderr, "GPU %d cannot access GPU %d\n", g, 1 - g);
      return 1;
    }
    CK(cudaDeviceEnablePeerAccess(1 - g, 0));
    CK(cudaStreamCreateWithFlags(&stream[g], cudaStreamNonBlocking));
    Side& s = side[g];
    __nv_bfloat16* x = nullptr;
    CK(cudaMalloc(&x, static_cast<size_t>(kTokens) * kHidden * 2));
    fill_bf16_inputs(x, static_cast<size_t>(kTokens) * kHidden, 12345u + 977u * g);  // a seed per GPU
    s.x = x;
    CK(cudaMalloc(&s.rows, kTokens * kRow));
    CK(cudaMemset(s.rows, 0, kTokens * kRow));
    CK(cudaMalloc(&s.own, kTokens * kOutRow));
    CK(cudaMalloc(&s.out, kMaxSlots * kTokens * kOutRow));
    CK(cudaMalloc(&s.flags, 2 * sizeof(uint64_t)));
    CK(cudaMemset(s.flags, 0, 2 * sizeof(uint64_t)));
    CK(cudaMalloc(&s.arrived, sizeof(unsigned long long)));
    CK(cudaMemset(s.arrived, 0, sizeof(unsigned long long)));
    CK(cudaMalloc(&s.go, sizeof(unsigned long long)));
    CK(cudaMemset(s.go, 0, sizeof(unsigned long long)));
    CK(cudaMalloc(&s.stamps, 2 * blocks * sizeof(uint64_t)));
    CK(cudaMalloc(&timeouts[g], sizeof(int)));
    CK(cudaMemset(timeouts[g], 0, sizeof(int)));
    s.timeouts = timeouts[g];
  }
  for (int g = 0; g < 2; ++g) {
    side[g].peer_rows = side[1 - g].rows;
    side[g].peer_flags = side[1 - g].flags;
  }

  uint64_t code = 0;
  // one exchange on both GPUs; returns the slower GPU's time in µs
  auto run = [&](const Config& c) {
    ++code;
    for (int g = 0; g < 2; ++g) {
      side[g].send_warps = c.send_warps;
      side[g].fence_every = c.fence_every;
      side[g].slots = c.slots;
      side[g].code = code;
      CK(cudaSetDevice(g));
      launch_mode(c.mode, side[g], blocks, stream[g]);
    }
    float worst = 0.f;
    std::vector<uint64_t> st(2 * blocks);
    for (int g = 0; g < 2; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaStreamSynchronize(stream[g]));
      CK(cudaMemcpy(st.data(), side[g].stamps, st.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
      uint64_t start = ~0ull, end = 0;
      for (int b = 0; b < blocks; ++b) {
        start = std::min(start, st[2 * b]);
        end = std::max(end, st[2 * b + 1]);
      }
      worst = std::max(worst, static_cast<float>(end - start) / 1000.f);
    }
    return worst;
  };

  std::vector<Config> configs;
  configs.push_back({kSendOnly, 0, 1, 1});
  for (int f : fence_every) configs.push_back({kSendMarked, 0, f, 1});
  for (int k : slots) {
    configs.push_back({kSeq, 0, 1, k});
    for (int w : send_warps)
      for (int f : fence_every) configs.push_back({kOverlap, w, f, k});
  }
  bool ok = true;
  std::printf("mode send_warps fence_every slots p50_us min_us\n");
  for (const Config& c : configs) {
    for (int i = 0; i < 3; ++i) run(c);
    std::vector<float> v;
    for (int i = 0; i < reps; ++i) v.push_back(run(c));
    std::sort(v.begin(), v.end());
    std::printf("%s %d %d %d %.1f %.1f\n", kModeNames[c.mode], c.send_warps, c.fence_every, c.slots, v[v.size() / 2],
                v.front());
    if (c.mode != kSeq && c.mode != kOverlap) continue;
    // every slot of every laid-out row against the row the peer kept
    std::vector<uint8_t> out(static_cast<size_t>(kTokens) * kOutRow), own(out.size());
    for (int g = 0; g < 2; ++g) {
      CK(cudaMemcpy(own.data(), side[1 - g].own, own.size(), cudaMemcpyDefault));
      for (int k = 0; k < c.slots; ++k) {
        CK(cudaMemcpy(out.data(), side[g].out + static_cast<int64_t>(k) * kTokens * kOutRow, out.size(),
                      cudaMemcpyDefault));
        if (out != own) {
          std::printf("check %s %d %d %d GPU %d slot %d: DIFFERENT\n", kModeNames[c.mode], c.send_warps,
                      c.fence_every, c.slots, g, k);
          ok = false;
        }
      }
    }
  }
  int t0 = 0, t1 = 0;
  CK(cudaMemcpy(&t0, timeouts[0], sizeof(int), cudaMemcpyDefault));
  CK(cudaMemcpy(&t1, timeouts[1], sizeof(int), cudaMemcpyDefault));
  std::printf("check laid-out rows: %s; timeouts %d\n", ok ? "identical" : "DIFFERENT", t0 + t1);
  std::printf("done\n");
  return ok && t0 + t1 == 0 ? 0 : 1;
}
