// The quantising send of a prefill dispatch: what bounds it on 24 SMs?
//
// At EP2, 4096 tokens, the fp8 dispatch's sends take about as long as the bf16 ones although they
// store half the bytes (docs/performance.md).  This program runs the library's own per-warp routines
// (csrc/common/quantise.cuh: warp_quant_fp8_multi; device.cuh: warp_copy_multi) over the same shape, one warp per
// token row, tokens strided over the grid's warps, and takes them apart:
//
//   copy_remote         bf16 row copied to a row on GPU 1 (the bf16 dispatch's send), 16 bytes per lane
//   copy_remote_8b      the same bytes stored 8 bytes per lane (as fp8 codes go out)
//   copy_remote_4b      the same bytes stored 4 bytes per lane (as NVFP4 codes go out)
//   copy_remote_own     the same to GPU 1 and to a local row (with this rank's own copy)
//   quant_remote        fp8 codes and float scales to a row on GPU 1
//   quant_remote_own    to GPU 1 and to a local row, one pass (what the fp8 dispatch does)
//   quant_remote_staged codes to GPU 1 through a per-warp shared-memory stage, 16 bytes per lane
//   quant_scales_local  codes to GPU 1, scales to a local row (the 4-byte remote scale stores taken out)
//   quant_local         codes and scales to a local row (NVLink taken out)
//   quant_l2            codes and scales to one small local row per warp (stores stay in L2: loads and
//                       the arithmetic alone)
//   load_only           the bf16 rows read and folded into a register (reads alone)
//   nvfp4_remote_staged NVFP4 codes and e4m3 scales to a row on GPU 1 through the shared-memory stage (what
//                       the NVFP4 dispatch sends; global scale 448 * 6 / 128)
//   nvfp4_l2            NVFP4 codes and scales to one small local row per warp (loads and arithmetic alone)
//   expand4             4096 local fp8 rows (codes and scales) each copied into 4 slots on GPU 0 (the
//                       batched dispatch's expansion of received rows), every warp
//   quant_own_expand4   the first --send-warps warps of each block do quant_remote_own while the others
//                       do expand4 at the same time: whether a compute-bound quantising send and a
//                       memory-bound expansion share 24 SMs better than running one after the other
//                       (quant_remote_own + expand4)
//
// The copy_remote* rows tell whether NVLink stores cost by the byte or by the store instruction.
//
// Rows are x: 4096 x 7168 bf16 on GPU 0; destinations 7168 bytes of codes then 56 float scales (fp8),
// 3584 bytes of codes then 448 e4m3 scales (NVFP4) or 14336 bytes (bf16) per row.  Prints `variant
// blocks p50_us min_us GBps` (GBps: bytes stored per destination row set / p50, or bytes read for
// load_only; quant_own_expand4 is named with its send warps, e.g. quant_own_expand4:10), then `done`.
// quant_remote's and quant_remote_staged's codes and scales are compared with quant_local's, byte for
// byte; exit code 1 on a difference.
//
// Build and run (2 GPUs, no torch; csrc/common/protocol_table.h comes from the library's build,
// `python3 -m pip install --no-build-isolation --no-deps -e .`):
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc bench/microbench/quant_send.cu -o qs && ./qs
//   options: --blocks 24,32 --variants quant_remote,quant_local --send-warps 8,10,12 (quant_own_expand4)
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
constexpr int kScales = kHidden / 128;
constexpr int64_t kQuantRow = kHidden + kScales * 4;  // codes, then float scales
constexpr int64_t kCopyRow = kHidden * 2;

enum Variant { kCopyRemote, kCopyRemote8, kCopyRemote4, kCopyRemoteOwn, kQuantRemote, kQuantRemoteOwn,
               kQuantRemoteStaged, kQuantScalesLocal, kQuantLocal, kQuantL2, kLoadOnly, kNvfp4RemoteStaged,
               kNvfp4L2, kExpand4, kQuantOwnExpand4, kVariants };
const char* const kNames[kVariants] = {"copy_remote", "copy_remote_8b", "copy_remote_4b", "copy_remote_own",
                                       "quant_remote", "quant_remote_own", "quant_remote_staged",
                                       "quant_scales_local", "quant_local", "quant_l2", "load_only",
                                       "nvfp4_remote_staged", "nvfp4_l2", "expand4", "quant_own_expand4"};
constexpr float kNvfp4GlobalScale = 448.0f * 6.0f / 128.0f;  // the inputs' amax is below 128

// a warp's copy of ``bytes`` with T-sized loads and stores per lane, 64 bytes per lane loaded before
// they are stored (the bytes in flight of warp_copy_multi's send side, whatever T)
template <typename T>
__device__ __forceinline__ void warp_copy_as(const uint8_t* src, uint8_t* dst, int64_t bytes, int lane) {
  constexpr int kU = 64 / static_cast<int>(sizeof(T));
  const T* s = reinterpret_cast<const T*>(src);
  T* o = reinterpret_cast<T*>(dst);
  const int64_t n = bytes / static_cast<int64_t>(sizeof(T));
  for (int64_t base = 0; base < n; base += kU * 32) {
    T v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (base + lane + u * 32 < n) v[u] = s[base + lane + u * 32];
#pragma unroll
    for (int u = 0; u < kU; ++u)
      if (base + lane + u * 32 < n) o[base + lane + u * 32] = v[u];
  }
}

struct Buffers {
  const __nv_bfloat16* x;  // [tokens][hidden] on GPU 0
  uint8_t* remote;         // [tokens][row] on GPU 1
  uint8_t* local;          // [tokens][row] on GPU 0
  uint8_t* scratch;        // [warps][row] on GPU 0
  float* sink;             // [warps] on GPU 0
  const uint8_t* rows;     // [tokens][quant row] on GPU 0: expand4's source
  uint8_t* slots;          // [4][tokens][quant row] on GPU 0: expand4's destinations
  int send_warps;          // quant_own_expand4: warps of a block that send; the others expand
};

// expand4's work for one warp: rows first, first + step, ... each into its 4 slots
__device__ void expand_rows(const Buffers& b, int first, int step, uint8_t** dst, int lane) {
  for (int t = first; t < kTokens; t += step) {
    if (lane < 4) dst[lane] = b.slots + (static_cast<int64_t>(lane) * kTokens + t) * kQuantRow;
    __syncwarp();
    ep_comm::warp_copy_multi<true>(b.rows + static_cast<int64_t>(t) * kQuantRow, dst, 4, kQuantRow, lane);
    __syncwarp();
  }
}

template <int kV>
__global__ void __launch_bounds__(kThreads, 1) send_kernel(Buffers b) {
  __shared__ __align__(16) uint8_t s_stage[kWarps][ep_comm::kQuantStageBytes];
  __shared__ uint8_t* s_dst[kWarps][4];
  __shared__ float* s_scl[kWarps][2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int gwarp = blockIdx.x * kWarps + warp, nwarps = gridDim.x * kWarps;
  uint8_t** dst = s_dst[warp];
  if (kV == kExpand4) {
    expand_rows(b, gwarp, nwarps, dst, lane);
    return;
  }
  if (kV == kQuantOwnExpand4) {  // split by role: the senders' loop below runs over the send warps only
    if (warp >= b.send_warps) {
      const int ne = kWarps - b.send_warps;
      expand_rows(b, blockIdx.x * ne + warp - b.send_warps, gridDim.x * ne, dst, lane);
      return;
    }
    gwarp = blockIdx.x * b.send_warps + warp;
    nwarps = gridDim.x * b.send_warps;
  }
  float** scl = s_scl[warp];
  float fold = 0.f;
  for (int t = gwarp; t < kTokens; t += nwarps) {
    const __nv_bfloat16* row = b.x + static_cast<int64_t>(t) * kHidden;
    if (kV == kLoadOnly) {
      const int4* s = reinterpret_cast<const int4*>(row);
      for (int i = lane; i < kHidden / 8; i += 32) {
        const int4 v = s[i];
        fold += __int_as_float(v.x ^ v.y ^ v.z ^ v.w);
      }
      continue;
    }
    if (kV == kCopyRemote8 || kV == kCopyRemote4) {
      uint8_t* to = b.remote + t * kCopyRow;
      if (kV == kCopyRemote8) warp_copy_as<uint2>(reinterpret_cast<const uint8_t*>(row), to, kCopyRow, lane);
      else warp_copy_as<uint32_t>(reinterpret_cast<const uint8_t*>(row), to, kCopyRow, lane);
      continue;
    }
    const bool copy = kV == kCopyRemote || kV == kCopyRemoteOwn;
    const int64_t stride = copy ? kCopyRow : kQuantRow;
    uint8_t* remote = b.remote + t * stride;
    uint8_t* local = b.local + t * stride;
    uint8_t* scratch = b.scratch + static_cast<int64_t>(gwarp) * kQuantRow;
    int nd = 1;
    if (lane == 0) {
      switch (kV) {
        case kCopyRemote: dst[0] = remote; break;
        case kCopyRemoteOwn: dst[0] = remote; dst[1] = local; nd = 2; break;
        case kNvfp4RemoteStaged: dst[0] = remote; scl[0] = reinterpret_cast<float*>(remote + kHidden / 2); break;
        case kNvfp4L2: dst[0] = scratch; scl[0] = reinterpret_cast<float*>(scratch + kHidden / 2); break;
        case kQuantRemote:
        case kQuantRemoteStaged: dst[0] = remote; scl[0] = reinterpret_cast<float*>(remote + kHidden); break;
        case kQuantRemoteOwn:
        case kQuantOwnExpand4:
          dst[0] = remote; scl[0] = reinterpret_cast<float*>(remote + kHidden);
          dst[1] = local; scl[1] = reinterpret_cast<float*>(local + kHidden);
          nd = 2;
          break;
        case kQuantScalesLocal: dst[0] = remote; scl[0] = reinterpret_cast<float*>(local + kHidden); break;
        case kQuantLocal: dst[0] = local; scl[0] = reinterpret_cast<float*>(local + kHidden); break;
        default: dst[0] = scratch; scl[0] = reinterpret_cast<float*>(scratch + kHidden); break;
      }
    }
    nd = __shfl_sync(0xffffffffu, nd, 0);
    __syncwarp();
    if (copy) ep_comm::warp_copy_multi<false>(reinterpret_cast<const uint8_t*>(row), dst, nd, kCopyRow, lane);
    else if (kV == kNvfp4RemoteStaged || kV == kNvfp4L2)  // codes, then the e4m3 scales
      ep_comm::warp_quant_nvfp4_multi<__nv_bfloat16>(row, kHidden, kNvfp4GlobalScale, dst,
                                                     reinterpret_cast<uint8_t* const*>(scl), nd, lane,
                                                     kV == kNvfp4RemoteStaged ? s_stage[warp] : nullptr);
    else
      ep_comm::warp_quant_fp8_multi<__nv_bfloat16>(row, kHidden, dst, scl, nd, lane,
                                                   kV == kQuantRemoteStaged ? s_stage[warp] : nullptr);
    __syncwarp();
  }
  if (kV == kLoadOnly && lane == 0) b.sink[gwarp] = fold;
}

template <int kV>
void launch(int blocks, const Buffers& b) { send_kernel<kV><<<blocks, kThreads>>>(b); }

void run(int v, int blocks, const Buffers& b) {
  switch (v) {
    case kCopyRemote: launch<kCopyRemote>(blocks, b); break;
    case kCopyRemote8: launch<kCopyRemote8>(blocks, b); break;
    case kCopyRemote4: launch<kCopyRemote4>(blocks, b); break;
    case kCopyRemoteOwn: launch<kCopyRemoteOwn>(blocks, b); break;
    case kQuantRemote: launch<kQuantRemote>(blocks, b); break;
    case kQuantRemoteOwn: launch<kQuantRemoteOwn>(blocks, b); break;
    case kQuantRemoteStaged: launch<kQuantRemoteStaged>(blocks, b); break;
    case kQuantScalesLocal: launch<kQuantScalesLocal>(blocks, b); break;
    case kQuantLocal: launch<kQuantLocal>(blocks, b); break;
    case kQuantL2: launch<kQuantL2>(blocks, b); break;
    case kNvfp4RemoteStaged: launch<kNvfp4RemoteStaged>(blocks, b); break;
    case kNvfp4L2: launch<kNvfp4L2>(blocks, b); break;
    case kExpand4: launch<kExpand4>(blocks, b); break;
    case kQuantOwnExpand4: launch<kQuantOwnExpand4>(blocks, b); break;
    default: launch<kLoadOnly>(blocks, b); break;
  }
  CK(cudaGetLastError());
}

int main(int argc, char** argv) {
  std::vector<int> blocks = {24};
  std::vector<int> variants;
  std::vector<int> send_warps = {10};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--blocks")) {
      blocks.clear();
      for (const auto& s : comma_list(argv[i + 1])) blocks.push_back(std::stoi(s));
    } else if (!std::strcmp(argv[i], "--variants")) {
      for (const auto& s : comma_list(argv[i + 1]))
        for (int v = 0; v < kVariants; ++v)
          if (s == kNames[v]) variants.push_back(v);
    } else if (!std::strcmp(argv[i], "--send-warps")) {
      send_warps.clear();
      for (const auto& s : comma_list(argv[i + 1])) send_warps.push_back(std::stoi(s));
    }
  }
  if (variants.empty())
    for (int v = 0; v < kVariants; ++v) variants.push_back(v);
  int ngpu = 0;
  CK(cudaGetDeviceCount(&ngpu));
  if (ngpu < 2) {
    std::fprintf(stderr, "needs 2 GPUs (found %d)\n", ngpu);
    return 1;
  }
  int can = 0;
  CK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (!can) {
    std::fprintf(stderr, "GPU 0 cannot access GPU 1\n");
    return 1;
  }
  Buffers b{};
  const int64_t row_max = std::max(kQuantRow, kCopyRow);
  CK(cudaSetDevice(1));
  uint8_t* remote = nullptr;
  CK(cudaMalloc(&remote, kTokens * row_max));
  CK(cudaMemset(remote, 0, kTokens * row_max));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  __nv_bfloat16* x = nullptr;
  uint8_t *local = nullptr, *scratch = nullptr;
  float* sink = nullptr;
  const int max_warps = *std::max_element(blocks.begin(), blocks.end()) * kWarps;
  CK(cudaMalloc(&x, static_cast<size_t>(kTokens) * kHidden * 2));
  CK(cudaMalloc(&local, kTokens * row_max));
  CK(cudaMalloc(&scratch, max_warps * kQuantRow));
  CK(cudaMalloc(&sink, max_warps * sizeof(float)));
  uint8_t *rows = nullptr, *slots = nullptr;
  CK(cudaMalloc(&rows, kTokens * kQuantRow));
  CK(cudaMemset(rows, 0x5a, kTokens * kQuantRow));
  CK(cudaMalloc(&slots, 4 * kTokens * kQuantRow));
  fill_bf16_inputs(x, static_cast<size_t>(kTokens) * kHidden, 12345u);
  b.x = x;
  b.remote = remote;
  b.local = local;
  b.scratch = scratch;
  b.sink = sink;
  b.rows = rows;
  b.slots = slots;

  bool ok = true;
  for (int v : {kQuantRemote, kQuantRemoteStaged}) {  // the same bytes as quant_local
    CK(cudaSetDevice(1));
    CK(cudaMemset(remote, 0, kTokens * row_max));
    CK(cudaSetDevice(0));
    run(v, blocks[0], b);
    run(kQuantLocal, blocks[0], b);
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> r(kTokens * kQuantRow), l(kTokens * kQuantRow);
    CK(cudaMemcpy(r.data(), remote, r.size(), cudaMemcpyDefault));
    CK(cudaMemcpy(l.data(), local, l.size(), cudaMemcpyDefault));
    const bool same = r == l;
    std::printf("check %s == quant_local: %s\n", kNames[v], same ? "identical" : "DIFFERENT");
    ok = ok && same;
  }
  std::printf("variant blocks p50_us min_us GBps\n");
  for (int nb : blocks) {
    for (int v : variants) {
      const bool copy = v == kLoadOnly || v == kCopyRemote || v == kCopyRemote8 || v == kCopyRemote4 ||
                        v == kCopyRemoteOwn;
      const bool nvfp4 = v == kNvfp4RemoteStaged || v == kNvfp4L2;
      const double per_row = copy ? kCopyRow : nvfp4 ? kHidden / 2 + kHidden / 16 : kQuantRow;
      for (int sw : v == kQuantOwnExpand4 ? send_warps : std::vector<int>{0}) {
        b.send_warps = sw;
        const auto [p50, mn] = p50_min_us([&] { run(v, nb, b); });
        const std::string name = sw ? std::string(kNames[v]) + ":" + std::to_string(sw) : kNames[v];
        std::printf("%s %d %.1f %.1f %.0f\n", name.c_str(), nb, p50, mn, per_row * kTokens / (p50 * 1e3));
      }
    }
  }
  std::printf("done\n");
  return ok ? 0 : 1;
}
