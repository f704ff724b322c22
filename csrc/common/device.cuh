// Device-side building blocks every kernel backend shares: memory-model helpers for one-sided
// signalling, bounded waits, the error record, vectorised element access and row copies.  The
// quantisers that build on them are in quantise.cuh.
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
// ``threads`` > 0: only the block's first ``threads`` threads (whole warps, thread 0 among them) arrive,
// meeting at named barrier 1, while the block's other warps go on with other work.
struct Arrival {
  bool last;
  bool ok;
};

__device__ __forceinline__ Arrival grid_arrive(unsigned long long* counter, bool wait, uint64_t deadline_ns,
                                               const ErrorSink& err, int threads = 0) {
  __shared__ unsigned long long s_target;
  __shared__ int s_last, s_ok;
  const auto block_sync = [threads] {
    if (threads > 0) asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
    else __syncthreads();
  };
  block_sync();
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
  block_sync();
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

// Ask the L2 for the cache line holding ``p`` (no register holds the result; a hint only).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

}  // namespace ep_comm
