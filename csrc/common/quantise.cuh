// The dispatch's quantisers, one warp per row piece: fp8 e4m3 with a float scale per 128 channels, and
// NVFP4 (e2m1 values, an e4m3 scale per 16 channels, a float32 global scale), each bit-identical to its
// torch reference (ep_comm.quant, ep_comm.quant_nvfp4).
#pragma once

#include <cfloat>

#include "common/device.cuh"

namespace ep_comm {

// ---- fp8 e4m3, per token per 128 channels ---------------------------------------------------------
// Bit-identical to ep_comm.quant.quantize_fp8: scale = max(amax, 1e-4) * fp32(1/448), q = RN(x / scale)
// clamped to +-448, every NaN written as 0x7FC00000 (scale) and 0x7F (byte): a NaN makes its block NaN,
// an inf its block's scale inf.  Explicit round-to-nearest intrinsics keep fast-math out of the recipe.
constexpr uint32_t kCanonicalNanBits = 0x7FC00000u;
constexpr float kFp8Max = 448.0f;
constexpr float kFp8AmaxFloor = 1e-4f;
constexpr float kFp8InvMax = 1.0f / 448.0f;

__device__ __forceinline__ uint8_t fp8_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Four floats that are not NaN to e4m3 bytes (a in the low byte), two per conversion instruction.
// Saturating to +-448 is the recipe's clamp for every number (448 is e4m3's largest).
__device__ __forceinline__ uint32_t fp8x4_e4m3_not_nan(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// The same for any floats: a NaN keeps its sign through the conversion, so every byte whose low 7 bits
// are set (e4m3's only NaN codes) loses its sign bit.
__device__ __forceinline__ uint32_t fp8x4_e4m3(float a, float b, float c, float d) {
  const uint32_t w = fp8x4_e4m3_not_nan(a, b, c, d);
  const uint32_t nan_bytes = ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return w & ~nan_bytes;
}

// x / s rounded to nearest, bit for bit __fdiv_rn(x, s), for a finite s > 0 and its correctly rounded
// reciprocal inv: x * inv is within one ulp of the quotient, and one FMA residual step makes it the
// correctly rounded one (Markstein's theorem).  A quotient small enough for the residual to underflow
// may differ in its last bit, far below fp8's smallest value (2^-9), so the fp8 byte is the same
// (bench/microbench/quant_arith.cu checks every float32 a block can hold).  The residual is taken as
// -(q * s - x), not x - q * s: the two differ only where it is zero, which is then -0 rather than +0,
// so that q + r * inv keeps q's sign where q is zero (x = -0 gives -0, as the quotient does) and is q
// otherwise.  Both negations are operand modifiers: 3 instructions.
__device__ __forceinline__ float div_by_scale(float x, float s, float inv) {
  const float q = __fmul_rn(x, inv);
  const float r = -__fmaf_rn(q, s, -x);
  return __fmaf_rn(r, inv, q);
}

// max(|a|, |b|) of each 16-bit half (bf16, or fp16 for T = __half), NaN where either is NaN; the sign
// bits of the result are noise (max.NaN.xorsign.abs gives them the XOR of the inputs' signs).
template <typename T>
__device__ __forceinline__ uint32_t abs_max_x2(uint32_t a, uint32_t b) {
  uint32_t r;
  if constexpr (std::is_same<T, __half>::value)
    asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  else
    asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// w[0] = the larger magnitudes of w[0 .. 2h) (h a power of two), as a tree: independent instructions
template <typename T, int h>
__device__ __forceinline__ void abs_max_tree(uint32_t* w) {
#pragma unroll
  for (int i = 0; i < h; ++i) w[i] = abs_max_x2<T>(w[i], w[i + h]);
  if constexpr (h > 1) abs_max_tree<T, h / 2>(w);
}

// The largest |element| of ``n`` Pack8s as a float, NaN if any element is NaN (torch.amax's).  16-bit
// inputs take it from the raw words, two elements an instruction, where the floats take one an
// element after unpacking; the maximum is exact in either format, so the scales are the same bits.
template <typename T, int n>
__device__ __forceinline__ float abs_max(const Pack8<T>* v) {
  if constexpr (sizeof(T) == 4) {
    float m = 0.f;
#pragma unroll
    for (int u = 0; u < n; ++u) {
      float f[8];
      v[u].unpack(f);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = nan_max(m, fabsf(f[i]));
    }
    return m;
  } else {
    uint32_t w[4 * n];
#pragma unroll
    for (int i = 0; i < 4 * n; ++i) w[i] = reinterpret_cast<const uint32_t*>(v)[i];
    abs_max_tree<T, 2 * n>(w);
    float lo, hi;
    if constexpr (std::is_same<T, __half>::value) {
      lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w[0] & 0xFFFFu)));
      hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w[0] >> 16)));
    } else {
      lo = __uint_as_float(w[0] << 16);
      hi = __uint_as_float(w[0] & 0xFFFF0000u);
    }
    return nan_max(fabsf(lo), fabsf(hi));
  }
}

// Channels a warp's quantiser takes per step (fp8: 8 blocks of 128; NVFP4: 64 blocks of 16), and the
// bytes it stages per step: fp8 codes, or NVFP4 codes (half of it) then their e4m3 scales.
constexpr int kQuantStep = 1024;
constexpr int kQuantStageBytes = kQuantStep;

// The warp's ``n`` staged bytes (a multiple of 16, ``stage`` 16-byte aligned) to each of ``nd``
// destinations at byte ``at``, 16 bytes per lane: a remote store instruction carries 512 bytes instead
// of the 256 (fp8) or 128 (NVFP4) the lanes' own codes make.  kSwizzled: logical byte o is staged at
// o ^ stage_swizzle(o) (fp8's stage, see there).  The caller brackets it with __syncwarp, so that the
// lanes' staging is complete and the next step does not overwrite what is being read.
__device__ __forceinline__ int stage_swizzle(int o) { return ((o >> 7) & 3) << 5; }

template <bool kSwizzled = false>
__device__ __forceinline__ void store_staged(const uint8_t* stage, int n, uint8_t* const* dst, int nd, int at,
                                             int lane) {
  for (int i = lane * 16; i < n; i += kWarpSize * 16) {
    const int4 v = *reinterpret_cast<const int4*>(stage + (kSwizzled ? i ^ stage_swizzle(i) : i));
    for (int d = 0; d < nd; ++d) *reinterpret_cast<int4*>(dst[d] + at + i) = v;
  }
}

// Whether every destination can take 16-byte stores at offsets that are multiples of 16.
__device__ __forceinline__ bool aligned16(uint8_t* const* dst, int nd) { return (address_bits(dst, nd) & 15) == 0; }

// One warp quantises one row of ``hidden`` elements (hidden % 128 == 0), 1024 channels a step: lanes
// 4b..4b+3 own the step's block b (128 channels), lane 4b+j its channels 32u + 8j .. +8 for u = 0..3.
// A block's maximum is then a 4-lane reduction, and each lane computes its block's scale and
// reciprocal once per 32 of its elements, while each load instruction still reads whole 32-byte
// sectors (lanes 4b..4b+3 read 64 contiguous bytes).  Writes the fp8 bytes and the float scales to
// every destination.
template <typename Tin>
__device__ __forceinline__ void warp_quant_fp8_multi(const Tin* x, int hidden, uint8_t* const* dst_q,
                                                     float* const* dst_s, int nd, int lane,
                                                     uint8_t* stage = nullptr) {
  constexpr int kParts = 4;  // a lane's 8-channel parts of its block
  const int blk = lane >> 2;
  const int mine = blk * 128 + (lane & 3) * 8;  // the lane's first channel in a step
  // the scales go out 32 at a time, lane j holding the j-th (one coalesced store per destination
  // instead of 4-byte stores per block, which over NVLink are packets of their own)
  float held = 0.f;
  int held_n = 0, held_base = 0;  // warp-uniform: scales held, index of the first
  // ``stage`` (kQuantStageBytes of this warp's shared memory): the codes go out through it.  Part u of
  // block b is staged at 128b + 32(u ^ (b & 3)) + 8j rather than 128b + 32u + 8j, so that the 16 lanes
  // of a half-warp's 8-byte stores hit 16 different bank pairs (unswizzled, blocks 0..3 collide)
  const bool staged = stage != nullptr && aligned16(dst_q, nd);
  // the next step's parts are loaded (raw, 4 registers per bf16 part) before this step's are
  // quantised, so that each step's arithmetic overlaps the next step's load latency
  Pack8<Tin> next[kParts];
  if (mine < hidden) {
#pragma unroll
    for (int u = 0; u < kParts; ++u) next[u].load(x + mine + 32 * u);
  }
  for (int base0 = 0; base0 < hidden; base0 += kQuantStep) {
    const bool active = base0 + mine < hidden;  // hidden % 128 == 0: whole blocks
    float amax = active ? abs_max<Tin, kParts>(next) : 0.f;
    float f[kParts][8];
#pragma unroll
    for (int u = 0; u < kParts; ++u) next[u].unpack(f[u]);
    if (base0 + kQuantStep + mine < hidden) {
#pragma unroll
      for (int u = 0; u < kParts; ++u) next[u].load(x + base0 + kQuantStep + mine + 32 * u);
    }
    amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    float scale = __fmul_rn(nan_max(amax, kFp8AmaxFloor), kFp8InvMax);
    uint2 packed[kParts];
    if (scale <= 3.0e38f) {
      const float inv = __frcp_rn(scale);
#pragma unroll
      for (int u = 0; u < kParts; ++u) {
        float q[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = div_by_scale(f[u][i], scale, inv);
        // a finite scale means a finite amax: no q is NaN
        packed[u] = make_uint2(fp8x4_e4m3_not_nan(q[0], q[1], q[2], q[3]), fp8x4_e4m3_not_nan(q[4], q[5], q[6], q[7]));
      }
    } else {  // amax inf or NaN
#pragma unroll
      for (int u = 0; u < kParts; ++u) {
        float q[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] = __fdiv_rn(f[u][i], scale);
        packed[u] = make_uint2(fp8x4_e4m3(q[0], q[1], q[2], q[3]), fp8x4_e4m3(q[4], q[5], q[6], q[7]));
      }
      if (scale != scale) scale = __uint_as_float(kCanonicalNanBits);
    }
    if (active) {
#pragma unroll
      for (int u = 0; u < kParts; ++u) {
        const int o = mine + 32 * u;
        if (staged) *reinterpret_cast<uint2*>(stage + (o ^ stage_swizzle(o))) = packed[u];
        else
          for (int d = 0; d < nd; ++d) *reinterpret_cast<uint2*>(dst_q[d] + base0 + o) = packed[u];
      }
    }
    if (staged) {
      __syncwarp();
      store_staged<true>(stage, min(kQuantStep, hidden - base0), dst_q, nd, base0, lane);
      __syncwarp();
    }
    // the step's nb block scales, block b's held by lanes 4b..4b+3, go to lanes held_n .. held_n + nb
    const int nb = min(kQuantStep, hidden - base0) / 128;
    const float v = __shfl_sync(0xffffffffu, scale, 4 * ((lane - held_n) & 7));
    if (lane >= held_n && lane < held_n + nb) held = v;
    held_n += nb;
    if (held_n > kWarpSize - kQuantStep / 128 || base0 + kQuantStep >= hidden) {
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

// float value of an e4m3 (fn) byte; NaN (0x7F / 0xFF) as NaN.  Exact: e4m3 is a subset of float16,
// which is a subset of float32 (sm_89's e4m3 to f16 conversion, then f16 to f32).
__device__ __forceinline__ float e4m3_value(uint32_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
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

// The e2m1 codes of eight q[i], packed as e2m1_code(q[i]) << 4i, for q[i] that are not NaN (every block
// whose amax and scale inverse are finite): |q| clamped to 6 lies in [2^k, 2^(k+1)) with k = 0, 1 or 2
// (k = 0 below 1), where e2m1's values are spaced 2^(k-1) apart and start at code 2k, so the code is 2k
// plus |q| * 2^(1-k) rounded to the nearest integer, ties to even (the e2m1 rounding: the even integer
// is the even code).  One FMA adding 1.5 * 2^23 does that rounding and leaves the integer in the
// float's low bits.  The multiplier 2^(1-k) is max(|q|, 1)'s exponent field inverted (255 - (127 + k)
// = 128 - k: one LOP3), and that field, shifted, is 256 - 2k, so the code is the FMA's bits minus it:
// each code carries the constant kBias, which the packed sum sheds once (arithmetic modulo 2^32).
// About 9 instructions an element where e2m1_code takes 16; the same codes for every float32
// (bench/microbench/quant_arith.cu).
// kSigned false: the codes of |q[i]|, to which the caller adds the sign bits (sign_nibbles).
template <bool kSigned = true>
__device__ __forceinline__ uint32_t e2m1_pack8(const float* q) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  constexpr uint32_t kBias = 0x4B400000u - 256u;  // kRound's bits - the inverted field's 256
  uint32_t sum = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float a = fminf(fabsf(q[i]), 6.0f);
    const uint32_t mult = ~__float_as_uint(fmaxf(a, 1.0f)) & 0x7F800000u;  // 2^(1-k)
    const float n = __fmaf_rn(a, __uint_as_float(mult), kRound);  // a * 2^(1-k) + kRound
    const uint32_t sign = kSigned ? (__float_as_uint(q[i]) >> 28) & 8u : 0u;
    sum += (__float_as_uint(n) - (mult >> 22) + sign) << (4 * i);
  }
  return sum - kBias * 0x11111111u;
}

// The sign bits of eight 16-bit floats (bf16 or fp16; element 2k in the low half of word k of ``w``)
// where e2m1_pack8 puts a code's sign: element i's at bit 4i + 3.  Word k's high bytes hold the signs
// of elements 2k (byte 1) and 2k + 1 (byte 3): gathering those bytes of the four words puts element
// 2k + 1's sign at bit 8k + 7 and element 2k's at 8k + 7 of the other gather, then 8k + 3.  Nine
// instructions for eight values, where taking each sign from its quotient costs two a value.
__device__ __forceinline__ uint32_t sign_nibbles(const int4& w) {
  const uint32_t w0 = w.x, w1 = w.y, w2 = w.z, w3 = w.w;
  const uint32_t odd = __byte_perm(__byte_perm(w0, w1, 0x0073u), __byte_perm(w2, w3, 0x0073u), 0x5410u);
  const uint32_t even = __byte_perm(__byte_perm(w0, w1, 0x0051u), __byte_perm(w2, w3, 0x0051u), 0x5410u);
  return (odd & 0x80808080u) | ((even >> 4) & 0x08080808u);
}

// One warp quantises ``channels`` consecutive elements of a row (channels % 16 == 0, x 16-byte
// aligned) with global scale ``gs``, 1024 channels a step: lane l owns the step's 16-channel blocks l
// and 32 + l (8 bytes of codes each, element 2i in the low nibble of byte i), so each block's maximum,
// e4m3 scale and gs / scale are computed once, by one lane, with no shuffle.  Writes the packed codes
// (channels / 2 bytes, 4-byte aligned destinations) and the e4m3 block scales (channels / 16 bytes, any
// alignment) to every destination.
template <typename Tin>
__device__ __forceinline__ void warp_quant_nvfp4_multi(const Tin* x, int channels, float gs, uint8_t* const* dst_q,
                                                       uint8_t* const* dst_s, int nd, int lane,
                                                       uint8_t* stage = nullptr) {
  constexpr int kBlocks = kQuantStep / kNvfp4Block / kWarpSize;  // a lane's blocks per step
  constexpr int kCodes = kQuantStep / 2;  // code bytes per step; the scales are staged after them
  // with ``stage`` (kQuantStageBytes of this warp's shared memory) a step's codes and scales go out
  // through it, 16 bytes per lane
  const bool codes_ok = stage != nullptr && aligned16(dst_q, nd), scales_ok = stage != nullptr && aligned16(dst_s, nd);
  // as in warp_quant_fp8_multi: the next step's blocks are loaded raw before this step's are quantised
  Pack8<Tin> next[kBlocks][2];
#pragma unroll
  for (int b = 0; b < kBlocks; ++b) {
    const int c = (b * kWarpSize + lane) * kNvfp4Block;
    if (c < channels) {
      next[b][0].load(x + c);
      next[b][1].load(x + c + 8);
    }
  }
  for (int base0 = 0; base0 < channels; base0 += kQuantStep) {
    // per step: staged where the step's bytes are whole 16-byte vectors (codes: n % 32, scales: n % 256)
    const int n = min(kQuantStep, channels - base0);
    const bool codes_staged = codes_ok && n % 32 == 0, scales_staged = scales_ok && n % 256 == 0;
    float f[kBlocks][16];
    // 16-bit inputs: the codes' sign bits straight from the raw words (on the finite path a quotient
    // has its input's sign: the block's gs / scale is finite and not negative)
    constexpr bool kRawSigns = sizeof(Tin) == 2;
    uint2 signs[kBlocks];
    float amaxes[kBlocks];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      if (kRawSigns) signs[b] = make_uint2(sign_nibbles(next[b][0].w[0]), sign_nibbles(next[b][1].w[0]));
      amaxes[b] = abs_max<Tin, 2>(next[b]);
      next[b][0].unpack(f[b]);
      next[b][1].unpack(f[b] + 8);
      const int c1 = base0 + kQuantStep + (b * kWarpSize + lane) * kNvfp4Block;
      if (c1 < channels) {
        next[b][0].load(x + c1);
        next[b][1].load(x + c1 + 8);
      }
    }
#pragma unroll
    for (int b = 0; b < kBlocks; ++b) {
      const int o = (b * kWarpSize + lane) * kNvfp4Block;  // the block's first channel in the step
      if (o >= n) continue;
      const float amax = amaxes[b];
      float s = __fmul_rn(__fmul_rn(amax, kE2m1InvMax), gs);
      s = s > kFp8Max ? kFp8Max : s;  // clamp(max=448) keeping NaN
      const uint32_t sf_code = fp8_e4m3(s);  // RNE; NaN -> 0x7F
      const float sf = e4m3_value(sf_code);
      const float os = sf > 0.f ? __fdiv_rn(gs, sf) : 0.f;  // NaN or zero scale: 0
      float q[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) q[i] = __fmul_rn(f[b][i], os);
      uint2 packed = make_uint2(0u, 0u);
      if (amax <= FLT_MAX && os <= FLT_MAX) {  // finite: no q is NaN (an overflow to inf codes as 6)
        if (kRawSigns) packed = make_uint2(e2m1_pack8<false>(q) + signs[b].x, e2m1_pack8<false>(q + 8) + signs[b].y);
        else packed = make_uint2(e2m1_pack8(q), e2m1_pack8(q + 8));
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          packed.x |= e2m1_code(q[i]) << (4 * i);
          packed.y |= e2m1_code(q[8 + i]) << (4 * i);
        }
      }
      const int c0 = base0 + o;
      if (codes_staged) {
        *reinterpret_cast<uint2*>(stage + o / 2) = packed;
      } else {
        for (int d = 0; d < nd; ++d) {
          uint32_t* at = reinterpret_cast<uint32_t*>(dst_q[d] + c0 / 2);
          at[0] = packed.x;
          at[1] = packed.y;
        }
      }
      if (scales_staged) stage[kCodes + o / kNvfp4Block] = static_cast<uint8_t>(sf_code);
      else
        for (int d = 0; d < nd; ++d) dst_s[d][c0 / kNvfp4Block] = static_cast<uint8_t>(sf_code);
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
