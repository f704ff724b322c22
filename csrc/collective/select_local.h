// The collective backends' (naive, ag_rs) layout selection as two or three kernels.
//
// After the all-gather every rank holds every rank's (token, k expert ids, k weights) rows.  Selection
// turns them into this rank's view: per (row, slot) the local expert id (-1 where the expert lives
// elsewhere, or repeats an earlier slot of the row), the row's weight for that expert summed over its
// repeats, whether the row has any local pair, and for the batched layout the pair's flat slot in
// [num_local * capacity] (row-major order per expert: the n-th pair of expert e gets slot n) with the
// per-expert counts, and finally the payload rows copied into those slots.  It stands in for a few
// dozen small torch ops per eager dispatch, each costing host time on the eager path.
// Host-compilable (ops.cpp includes it): declarations only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep_comm {
namespace collective {

struct SelectLocalParams {
  // gathered ids (int32) and weights (float32): row r's k entries start at
  // base + (r / rows_per_chunk) * chunk_stride + (r % rows_per_chunk) * row_stride (elements)
  const int32_t* ids;
  const float* weights;
  int64_t rows, k, rows_per_chunk;
  int64_t ids_chunk_stride, ids_row_stride, w_chunk_stride, w_row_stride;
  int32_t rank, num_local;
  int64_t capacity;
  int32_t* local_ids;  // [rows, k]
  float* local_w;      // [rows, k]
  bool* row_valid;     // [rows]
  int64_t* dest;       // [rows, k] or null (standard layout); pairs not here: num_local * capacity + row
  int32_t* counts;     // [num_local] or null
};

// Launches on ``stream``: no synchronisation, no allocation (CUDA-graph capturable).
cudaError_t launch_select_local(const SelectLocalParams& p, cudaStream_t stream);

struct ScatterRowsParams {
  const uint8_t* src;  // row r at src + r * src_stride (bytes)
  int64_t rows, row_bytes, src_stride;
  const int64_t* dest;  // [rows, k]: a slot in [0, slots) receives the row; any other value: nothing
  int64_t k, slots;
  uint8_t* out;  // [slots, row_bytes]
};

// ``vectorised``: 16-byte copies (row_bytes, src_stride and both pointers 16-byte aligned).
cudaError_t launch_scatter_rows(const ScatterRowsParams& p, bool vectorised, cudaStream_t stream);

}  // namespace collective
}  // namespace ep_comm
