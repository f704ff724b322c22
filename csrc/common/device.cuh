// Device-side building blocks every kernel backend shares: memory-model helpers for one-sided
// signalling, bounded waits, the error record, vectorised row copies and the fp8 recipe.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/protocol.h"

namespace ep_comm {

constexpr int kWarpSize = 32;

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Flags live in memory that peers write over NVLink: acquire/release at system scope orders the
// payload stores before the flag on the sender and the payload loads after it on the receiver.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long ld_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_volatile_sys_i32(int32_t* p, int32_t v) {
  asm volatile("st.volatile.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Received data is read once, right after its flag: bypass L1 so no line cached before the flag
// can be served.
__device__ __forceinline__ int4 ld_cg(const int4* p) { return __ldcg(p); }

// ---- the error record -------------------------------------------------------------------------
// ``status`` is device memory (int32, layout in protocol.h); ``pending`` points at host-mapped int32
// words the host reads without synchronising: [kPendingFatal] when a peer problem was recorded (the
// call sequence is broken), [kPendingRecoverable] when only ids were dropped or a peer abandoned a
// call (ranks still in step).
struct ErrorSink {
  int32_t* status;
  int32_t* pending;
  int world;

  __device__ void count(int slot, int n) const {
    atomicAdd(status + slot, n);
    raise_pending(slot == kStatusInvalidIds ? kPendingRecoverable : kPendingFatal);
  }
  __device__ void peer(int r, int reason, uint32_t observed, uint32_t expected) const {
    atomicOr(status + kStatusRankReason + r, reason);
    atomicExch(status + kStatusRankReason + world + r, static_cast<int32_t>(observed));
    atomicCAS(status + kStatusExpectedCode, 0, static_cast<int32_t>(expected));
    // a peer that abandoned a call gave up the call numbers its peers make meanwhile (a dispatch
    // abort also covers the combine after it), so only these calls' results are incomplete; anything
    // else breaks the sequence
    raise_pending(reason == kReasonAbort ? kPendingRecoverable : kPendingFatal);
  }
  __device__ void raise_pending(int word) const {
    __threadfence();
    if (pending != nullptr) {
      st_volatile_sys_i32(pending + word, 1);
      __threadfence_system();
    }
  }
};

// Set in a call flag written by an input verdict (dispatch.cu): the dispatch's code, but not its data.
constexpr uint64_t kVerdictMark = 1ull << 63;

// Whether a peer's call flag ``seen`` shows it on another call than ``expected`` (recorded): the same
// call number with another op (an abort is a peer's input error, anything else a mismatch), or a
// later call.  0, ``expected`` itself and stale codes of earlier calls are not.
__device__ __forceinline__ bool on_other_call(uint32_t seen, uint32_t expected, int peer, const ErrorSink& err) {
  if (seen == 0 || seen == expected) return false;
  if (code_seq(seen) == code_seq(expected)) {
    err.peer(peer, code_op(seen) == kOpAbort ? kReasonAbort : kReasonMismatch, seen, expected);
    return true;
  }
  if (code_ahead(seen, expected)) {
    err.peer(peer, kReasonMismatch, seen, expected);
    return true;
  }
  return false;
}

// Wait until a peer's flag carries ``expected`` (unmarked).  Returns the flag (code in the low 32 bits) or 0
// after recording why it gave up: timeout (peer missing), or a code that can only come from a
// peer on another call.  Stale codes of earlier calls are waited through.
__device__ __forceinline__ uint64_t wait_flag(const uint64_t* flag, uint32_t expected, int peer,
                                              uint64_t deadline_ns, const ErrorSink& err) {
  uint32_t spins = 0;
  while (true) {
    const uint64_t v = ld_acquire_sys(flag);
    const uint32_t code = static_cast<uint32_t>(v);
    if (code == expected && !(v & kVerdictMark)) return v;
    if (on_other_call(code, expected, peer, err)) return 0;
    if ((++spins & 255u) == 0 && global_timer_ns() > deadline_ns) {
      err.peer(peer, kReasonTimeout, code, expected);
      err.count(kStatusTimeouts, 1);
      return 0;
    }
  }
}

// Arrive at this launch's grid-wide counter (monotonic: every launch adds gridDim.x, so no reset is
// needed between launches).  Thread 0 releases the block's stores (remote ones included) first, so
// the last block to arrive may signal peers on everyone's behalf.  With ``wait`` every block also
// waits for the others; that only gives up (and records it) if the grid was not all resident.
struct Arrival {
  bool last;
  bool ok;
};

__device__ __forceinline__ Arrival grid_arrive(unsigned long long* counter, bool wait, uint64_t deadline_ns,
                                               const ErrorSink& err) {
  __shared__ unsigned long long s_target;
  __shared__ int s_last, s_ok;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned long long old = atomicAdd(counter, 1ull);
    const unsigned long long g = gridDim.x;
    s_target = (old / g + 1) * g;
    s_last = (old + 1 == s_target) ? 1 : 0;
    s_ok = 1;
    if (s_last) {
      // acquire every other block's released stores before signalling.  GPU scope is enough: the
      // blocks share this GPU, and a later release at system scope (the signal) carries what this
      // fence acquired to the peers (causality order is transitive; their stores, remote ones too,
      // were released at system scope above); a system-scope fence here would cost latency on every
      // op (docs/performance.md).
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
    } else if (wait) {
      uint32_t spins = 0;
      while (ld_acquire_gpu(counter) < s_target) {
        if ((++spins & 255u) == 0 && global_timer_ns() > deadline_ns) {
          err.count(kStatusLocalStall, 1);
          s_ok = 0;
          break;
        }
      }
    }
  }
  __syncthreads();
  return Arrival{s_last != 0, s_ok != 0};
}

// ---- vectorised element access ----------------------------------------------------------------
// Two 16-bit elements as one 32-bit word, and their conversions to and from a float pair.
template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ static float2 to_float2(type v) { return __bfloat1622float2(v); }
  __device__ static type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Pair<__half> {
  using type = __half2;
  __device__ static float2 to_float2(type v) { return __half22float2(v); }
  __device__ static type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};

// 8 consecutive elements of T as stored (16 bytes of bf16/fp16, 32 of fp32): loaded raw, so that many
// loads can be in flight per lane (4 registers each instead of 8 floats), converted when used.
template <typename T>
struct Pack8 {
  static constexpr int kWords = static_cast<int>(sizeof(T)) / 2;
  int4 w[kWords];

  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = reinterpret_cast<const int4*>(p)[i];
  }
  __device__ __forceinline__ void load_cg(const T* p) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = ld_cg(reinterpret_cast<const int4*>(p) + i);
  }
  __device__ __forceinline__ void store(T* p) const {
#pragma unroll
    for (int i = 0; i < kWords; ++i) reinterpret_cast<int4*>(p)[i] = w[i];
  }
  __device__ __forceinline__ void unpack(float* f) const {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = reinterpret_cast<const float*>(w)[e];
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 v = Pair<T>::to_float2(reinterpret_cast<const typename Pair<T>::type*>(w)[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
      }
    }
  }
  __device__ __forceinline__ void pack(const float* f) {  // round to nearest
    if constexpr (sizeof(T) == 4) {
#pragma unroll
      for (int e = 0; e < 8; ++e) reinterpret_cast<float*>(w)[e] = f[e];
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        reinterpret_cast<typename Pair<T>::type*>(w)[i] = Pair<T>::from_floats(f[2 * i], f[2 * i + 1]);
    }
  }
  // acc[e] += scale * element e
  __device__ __forceinline__ void fma_into(float scale, float* acc) const {
    float f[8];
    unpack(f);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = fmaf(scale, f[e], acc[e]);
  }
};

// 8 elements of T (16-byte aligned), loaded and stored as floats
template <typename T>
struct Vec8 {
  __device__ static void load(const T* p, float* f) {
    Pack8<T> v;
    v.load(p);
    v.unpack(f);
  }
  __device__ static void load_cg(const T* p, float* f) {
    Pack8<T> v;
    v.load_cg(p);
    v.unpack(f);
  }
  __device__ static void store(T* p, const float* f) {
    Pack8<T> v;
    v.pack(f);
    v.store(p);
  }
};

template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// ---- row copies (one warp) ----------------------------------------------------------------------
// ``a`` ORed with the ``nd`` destination addresses: the low bits of the result are the widest alignment
// they all share.
__device__ __forceinline__ uintptr_t address_bits(uint8_t* const* dst, int nd, uintptr_t a = 0) {
  for (int d = 0; d < nd; ++d) a |= reinterpret_cast<uintptr_t>(dst[d]);
  return a;
}

// Copy ``bytes`` from ``src`` to each of ``nd`` destinations: every source chunk is loaded once and
// stored nd times.  ``cg_src``: the source was written by a peer (read around L1).  Chunk width
// follows the common alignment of the pointers and the length (16 bytes on every hot path).
template <bool kCgSrc>
__device__ __forceinline__ void warp_copy_multi(const uint8_t* src, uint8_t* const* dst, int nd, int64_t bytes,
                                                int lane) {
  if (nd == 0) return;
  const uintptr_t align = address_bits(dst, nd, reinterpret_cast<uintptr_t>(src) | static_cast<uintptr_t>(bytes));
  if ((align & 15) == 0) {
    const int64_t n = bytes >> 4;
    const int4* s = reinterpret_cast<const int4*>(src);
    // receive-side copies are bound by loads in flight (128 bytes per lane); send-side ones by their
    // stores (fewer registers then).  Every block of kUnroll x 32 vectors, the last one masked, issues
    // all its loads before its stores: the stores may alias the source as far as the compiler knows,
    // so a vector at a time would wait out a load's latency per vector (a decode-sized piece of
    // 1792 bytes is 3.5 vectors per lane).
    constexpr int kUnroll = kCgSrc ? 8 : 4;
    for (int64_t base = 0; base < n; base += kUnroll * kWarpSize) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + lane + u * kWarpSize;
        if (i < n) v[u] = kCgSrc ? ld_cg(s + i) : s[i];
      }
      for (int d = 0; d < nd; ++d) {
        int4* o = reinterpret_cast<int4*>(dst[d]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + lane + u * kWarpSize;
          if (i < n) o[i] = v[u];
        }
      }
    }
  } else if ((align & 3) == 0) {
    const int64_t n = bytes >> 2;
    const int32_t* s = reinterpret_cast<const int32_t*>(src);
    for (int64_t i = lane; i < n; i += kWarpSize) {
      const int32_t v = kCgSrc ? __ldcg(s + i) : s[i];
      for (int d = 0; d < nd; ++d) reinterpret_cast<int32_t*>(dst[d])[i] = v;
    }
  } else {
    for (int64_t i = lane; i < bytes; i += kWarpSize) {
      const uint8_t v = kCgSrc ? static_cast<uint8_t>(__ldcg(reinterpret_cast<const char*>(src) + i)) : src[i];
      for (int d = 0; d < nd; ++d) dst[d][i] = v;
    }
  }
}

// max(a, b) that keeps a NaN of either (torch.amax and clamp propagate NaN; fmaxf would drop it): one
// instruction (sm_80+), where a comparison and a select per element cost three
__device__ __forceinline__ float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ---- fp8 e4m3, per token per 128 channels ---------------------------------------------------------
// Bit-identical to ep_comm.quant.quantize_fp8: scale = max(amax, 1e-4) * fp32(1/448), q = RN(x / scale)
// clamped to +-448, every NaN written as 0x7FC00000 (scale) and 0x7F (byte): a NaN makes its block NaN,
// an inf its block's scale inf.  Explicit round-to-nearest intrinsics keep fast-math out of the recipe.
constexpr uint32_t kCanonicalNanBits = 0x7FC00000u;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;
constexpr float kFp8InvMax = 1.0f / 448.0f;
constexpr int kQuantAhead = 4;  // pieces of 256 channels a lane loads before quantising the first

__device__ __forceinline__ uint8_t fp8_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Four floats to e4m3 bytes (a in the low byte), two per conversion instruction.  Saturating to +-448 is
// the recipe's clamp for every number (448 is e4m3's largest); a NaN keeps its sign through the
// conversion, so every byte whose low 7 bits are set (e4m3's only NaN codes) loses its sign bit.
__device__ __forceinline__ uint32_t fp8x4_e4m3(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  const uint32_t w = lo | (hi << 16);
  const uint32_t nan_bytes = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return w & ~nan_bytes;
}

// x / s rounded to nearest, bit for bit __fdiv_rn(x, s), for a finite s > 0 and its correctly rounded
// reciprocal inv: x * inv is within one ulp of the quotient, and one FMA residual step makes it the
// correctly rounded one (Markstein's theorem).  A quotient small enough for the residual to underflow
// may differ in its last bit, far below fp8's smallest value (2^-9), so the fp8 byte is the same.  The
// sign is x's, as the quotient's is (x = -0 gives -0, which the FMA step alone turns into +0).
__device__ __forceinline__ float div_by_scale(float x, float s, float inv) {
  const float q = __fmul_rn(x, inv);
  const float r = __fmaf_rn(-q, s, x);
  return copysignf(__fmaf_rn(r, inv, q), x);
}

// Bytes a warp's quantiser stages per step: kQuantAhead pieces of 256 channels of fp8 codes (NVFP4: half
// of it for codes, then its e4m3 scales).
constexpr int kQuantStageBytes = kQuantAhead * 8 * kWarpSize;

// The warp's ``n`` staged bytes (a multiple of 16, ``stage`` 16-byte aligned) to each of ``nd``
// destinations at byte ``at``, 16 bytes per lane: a remote store instruction carries 512 bytes instead
// of the 256 (fp8) or 128 (NVFP4) the lanes' own codes make.  The caller brackets it with __syncwarp, so
// that the lanes' staging is complete and the next step does not overwrite what is being read.
__device__ __forceinline__ void store_staged(const uint8_t* stage, int n, uint8_t* const* dst, int nd, int at,
                                             int lane) {
  for (int i = lane * 16; i < n; i += kWarpSize * 16) {
    const int4 v = *reinterpret_cast<const int4*>(stage + i);
    for (int d = 0; d < nd; ++d) *reinterpret_cast<int4*>(dst[d] + at + i) = v;
  }
}

// Whether every destination can take 16-byte stores at offsets that are multiples of 16.
__device__ __forceinline__ bool aligned16(uint8_t* const* dst, int nd) { return (address_bits(dst, nd) & 15) == 0; }

// Ask the L2 for the cache line holding ``p`` (no register holds the result; a hint only).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// One warp quantises one row of ``hidden`` elements (hidden % 128 == 0): each lane owns 8
// consecutive channels, 16 lanes one 128-channel block.  Writes the fp8 bytes and the float scales
// to every destination.
template <typename Tin>
__device__ __forceinline__ void warp_quant_fp8_multi(const Tin* x, int hidden, uint8_t* const* dst_q,
                                                     float* const* dst_s, int nd, int lane,
                                                     uint8_t* stage = nullptr) {
  // kQuantAhead pieces of 256 channels at a time, each step over all of them before the next (loads,
  // block maxima, their shuffles, the quantisation, the stores): with a dispatch block's 16 warps per
  // SM, a chain of dependent steps per piece left the SM waiting on latency
  constexpr int kStep = 8 * kWarpSize;
  // the scales go out 32 at a time, lane j holding the j-th (one coalesced store per destination
  // instead of two 4-byte stores per 256 channels, which over NVLink are packets of their own)
  float held = 0.f;
  int held_n = 0, held_base = 0;  // warp-uniform: scales held, index of the first
  // ``stage`` (kQuantStageBytes of this warp's shared memory): the codes go out through it
  const bool staged = stage != nullptr && aligned16(dst_q, nd);
  // the next step's pieces are loaded (raw, 4 registers per bf16 piece) before this step's are
  // quantised, so that each step's arithmetic overlaps the next step's load latency
  Pack8<Tin> next[kQuantAhead];
#pragma unroll
  for (int u = 0; u < kQuantAhead; ++u)
    if (u * kStep + lane * 8 < hidden) next[u].load(x + u * kStep + lane * 8);
  for (int base0 = 0; base0 < hidden; base0 += kQuantAhead * kStep) {
    float f[kQuantAhead][8];
    float amax[kQuantAhead];
#pragma unroll
    for (int u = 0; u < kQuantAhead; ++u) {
      amax[u] = 0.f;
      next[u].unpack(f[u]);
      const int c1 = base0 + (kQuantAhead + u) * kStep + lane * 8;
      if (c1 < hidden) next[u].load(x + c1);
    }
#pragma unroll
    for (int u = 0; u < kQuantAhead; ++u) {
      if (base0 + u * kStep + lane * 8 < hidden) {
#pragma unroll
        for (int i = 0; i < 8; ++i) amax[u] = nan_max(amax[u], fabsf(f[u][i]));
      }
    }
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
#pragma unroll
      for (int u = 0; u < kQuantAhead; ++u) amax[u] = nan_max(amax[u], __shfl_xor_sync(0xffffffffu, amax[u], off, 16));
    }
    float scale[kQuantAhead];
    uint2 packed[kQuantAhead];
#pragma unroll
    for (int u = 0; u < kQuantAhead; ++u) {
      scale[u] = __fmul_rn(nan_max(amax[u], kFp8AmaxFloor), kFp8InvMax);
      float q[8];
      if (scale[u] <= 3.0e38f) {
        const float inv = __frcp_rn(scale[u]);
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = div_by_scale(f[u][i], scale[u], inv);
      } else {  // amax inf or NaN
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = __fdiv_rn(f[u][i], scale[u]);
        if (scale[u] != scale[u]) scale[u] = __uint_as_float(kCanonicalNanBits);
      }
      packed[u] = make_uint2(fp8x4_e4m3(q[0], q[1], q[2], q[3]), fp8x4_e4m3(q[4], q[5], q[6], q[7]));
    }
#pragma unroll
    for (int u = 0; u < kQuantAhead; ++u) {
      const int c0 = base0 + u * kStep + lane * 8;
      if (c0 >= hidden) continue;
      if (staged) *reinterpret_cast<uint2*>(stage + u * kStep + lane * 8) = packed[u];
      else
        for (int d = 0; d < nd; ++d) *reinterpret_cast<uint2*>(dst_q[d] + c0) = packed[u];
    }
    if (staged) {
      __syncwarp();
      store_staged(stage, min(kQuantAhead * kStep, hidden - base0), dst_q, nd, base0, lane);
      __syncwarp();
    }
    // block (base0 + u * kStep) / 128 + half's scale is held by lanes [16 * half, 16 * half + 16)
#pragma unroll
    for (int u = 0; u < kQuantAhead; ++u) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float v = __shfl_sync(0xffffffffu, scale[u], 16 * half);
        if (base0 + u * kStep + half * 128 < hidden) {
          if (lane == held_n) held = v;
          ++held_n;
        }
      }
    }
    if (held_n > kWarpSize - 2 * kQuantAhead || base0 + kQuantAhead * kStep >= hidden) {
      for (int d = 0; d < nd; ++d)
        if (lane < held_n) dst_s[d][held_base + lane] = held;
      held_base += held_n;
      held_n = 0;
    }
  }
}

// ---- NVFP4: e2m1 values, an e4m3 scale per 16 channels, a float32 global scale -------------------
// Bit-identical to ep_comm.quant_nvfp4.quantize_nvfp4 (its docstring gives the recipe): every step is
// one IEEE float32 operation in the reference's order (explicit round-to-nearest intrinsics, so nothing
// is contracted into an FMA or turned into a reciprocal), and e2m1 rounding is the reference's own
// comparisons, as sm_90 has no e2m1 conversion instruction.
constexpr int kNvfp4Block = 16;
constexpr float kE2m1InvMax = 1.0f / 6.0f;  // fl32(1/6): the reference's _INV_E2M1_MAX

// float value of an e4m3 (fn) byte; NaN (0x7F / 0xFF) as NaN.  Exact: e4m3 is a subset of float32.
__device__ __forceinline__ float e4m3_value(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  float v;
  if ((b & 0x7Fu) == 0x7Fu) v = __uint_as_float(0x7FC00000u);
  else if (e == 0) v = static_cast<float>(m) * 0.001953125f;  // m * 2^-9 (subnormal), exact
  else v = __uint_as_float(((e + 120u) << 23) | (m << 20));  // 2^(e-7) * (1 + m/8)
  return (b & 0x80u) ? -v : v;
}

// e2m1 code (sign in bit 3) of q: round to nearest, ties to even, saturating at +-6; NaN is +0.  From
// the bits, as sm_90 has no e2m1 conversion: |q| >= 1 rounds its float mantissa to one bit (ties to
// even), which makes the code 2 * exponent + that bit - 252 (at most 7); |q| < 1 is the integer
// nearest 2|q| (ties to even: adding 2^23 leaves it in the low bits).  The same codes as comparing
// |q| with the midpoints 0.25, 0.75, ..., 5 (every float32 checked).
__device__ __forceinline__ uint32_t e2m1_code(float q) {
  const uint32_t bits = __float_as_uint(q);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const float a = __uint_as_float(mag);
  const uint32_t big = min((mag + 0x1FFFFFu + ((mag >> 22) & 1u)) >> 22, 259u) - 252u;
  const uint32_t small = __float_as_uint(__fadd_rn(__fmul_rn(a, 2.0f), 8388608.0f)) & 3u;
  const uint32_t c = (a < 1.0f ? small : big) | ((bits >> 31) << 3);
  return a != a ? 0u : c;
}

// One warp quantises ``channels`` consecutive elements of a row (channels % 16 == 0, x 16-byte
// aligned) with global scale ``gs``: each lane owns 8 consecutive channels (4 bytes of codes, element
// 2i in the low nibble of byte i), a lane pair one 16-channel block.  Writes the packed codes
// (channels / 2 bytes, 4-byte aligned destinations) and the e4m3 block scales (channels / 16 bytes,
// any alignment) to every destination.
template <typename Tin>
__device__ __forceinline__ void warp_quant_nvfp4_multi(const Tin* x, int channels, float gs, uint8_t* const* dst_q,
                                                       uint8_t* const* dst_s, int nd, int lane,
                                                       uint8_t* stage = nullptr) {
  // kQuantAhead pieces of 256 channels are loaded before any is quantised: one 16-byte load per lane
  // in flight left the loop waiting on memory latency once per piece.  With ``stage`` (kQuantStageBytes
  // of this warp's shared memory) a step's codes and scales go out through it, 16 bytes per lane.
  constexpr int kCodes = kQuantAhead * 4 * kWarpSize;  // code bytes per step
  const bool codes_ok = stage != nullptr && aligned16(dst_q, nd), scales_ok = stage != nullptr && aligned16(dst_s, nd);
  constexpr int kStep = 8 * kWarpSize;
  // as in warp_quant_fp8_multi: the next step's pieces are loaded raw before this step's are quantised
  Pack8<Tin> next[kQuantAhead];
#pragma unroll
  for (int u = 0; u < kQuantAhead; ++u)
    if (u * kStep + lane * 8 < channels) next[u].load(x + u * kStep + lane * 8);
  for (int base0 = 0; base0 < channels; base0 += kQuantAhead * kStep) {
    // per step: staged where the step's bytes are whole 16-byte vectors (codes: n % 32, scales: n % 256)
    const int n = min(kQuantAhead * kStep, channels - base0);
    const bool codes_staged = codes_ok && n % 32 == 0, scales_staged = scales_ok && n % 256 == 0;
    float f[kQuantAhead][8];
#pragma unroll
    for (int u = 0; u < kQuantAhead; ++u) {
      next[u].unpack(f[u]);
      const int c1 = base0 + (kQuantAhead + u) * kStep + lane * 8;
      if (c1 < channels) next[u].load(x + c1);
    }
#pragma unroll
    for (int u = 0; u < kQuantAhead; ++u) {
      const int base = base0 + u * kStep;
      if (base >= channels) break;  // the same for every lane
      const int c0 = base + lane * 8;
      const bool active = c0 < channels;
      float amax = 0.f;
      if (active) {
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = nan_max(fabsf(f[u][i]), amax);
      }
      amax = nan_max(__shfl_xor_sync(0xffffffffu, amax, 1), amax);
      if (!active) continue;
      float s = __fmul_rn(__fmul_rn(amax, kE2m1InvMax), gs);
      s = s > kFp8Max ? kFp8Max : s;  // clamp(max=448) keeping NaN
      const uint32_t sf_code = fp8_e4m3(s);  // RNE; NaN -> 0x7F
      const float sf = e4m3_value(sf_code);
      const float os = sf > 0.f ? __fdiv_rn(gs, sf) : 0.f;  // NaN or zero scale: 0
      uint32_t packed = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) packed |= e2m1_code(__fmul_rn(f[u][i], os)) << (4 * i);
      if (codes_staged) *reinterpret_cast<uint32_t*>(stage + (c0 - base0) / 2) = packed;
      else
        for (int d = 0; d < nd; ++d) *reinterpret_cast<uint32_t*>(dst_q[d] + c0 / 2) = packed;
      if ((lane & 1) == 0) {
        if (scales_staged) stage[kCodes + (c0 - base0) / kNvfp4Block] = static_cast<uint8_t>(sf_code);
        else
          for (int d = 0; d < nd; ++d) dst_s[d][c0 / kNvfp4Block] = static_cast<uint8_t>(sf_code);
      }
    }
    if (codes_staged || scales_staged) {
      __syncwarp();
      if (codes_staged) store_staged(stage, n / 2, dst_q, nd, base0 / 2, lane);
      if (scales_staged) store_staged(stage + kCodes, n / kNvfp4Block, dst_s, nd, base0 / kNvfp4Block, lane);
      __syncwarp();
    }
  }
}

}  // namespace ep_comm
