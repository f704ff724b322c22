// Host-side helpers of the ops in both extensions: CUDA call checks, dtype codes, row alignment.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "common/protocol.h"

namespace ep_comm {

#define EP_CUDA_CHECK(expr)                                                                      \
  do {                                                                                           \
    const cudaError_t err__ = (expr);                                                            \
    TORCH_CHECK(err__ == cudaSuccess, "ep_comm: ", #expr, " failed: ", cudaGetErrorString(err__)); \
  } while (0)

inline int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return kBf16;
    case at::kHalf: return kFp16;
    case at::kFloat: return kFp32;
    default: TORCH_CHECK(false, "ep_comm: unsupported dtype ", t);
  }
}

inline at::ScalarType dtype_of(int64_t code) {
  switch (code) {
    case kBf16: return at::kBFloat16;
    case kFp16: return at::kHalf;
    default: return at::kFloat;
  }
}

// 16-byte aligned and contiguous: the kernels move rows in 16-byte vectors.
inline at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

// Rows 16-byte aligned and contiguous within, any row pitch that keeps them aligned: a row-strided
// view (the dispatch input written into the communicator's buffer) is used where it lies.
inline at::Tensor aligned_rows(const at::Tensor& t) {
  const bool rows_ok = t.dim() == 2 && t.stride(1) == 1 && t.stride(0) >= t.size(1) &&
                       (t.stride(0) * t.element_size()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return rows_ok ? t : aligned(t);
}

inline int64_t row_pitch_bytes(const at::Tensor& t) {
  return t.dim() == 2 && t.size(0) > 1 ? t.stride(0) * t.element_size() : t.size(-1) * t.element_size();
}

}  // namespace ep_comm
