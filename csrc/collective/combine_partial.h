// The collective backends' (naive, ag_rs) batched-combine partial sums as one kernel.
//
// Per row r of the gathered token table and each of its k (row, expert) pairs, dest[r][j] is the
// pair's flat slot in the batched expert output [L * capacity, hidden] when the expert lives on this
// rank, and any value outside [0, slots) when it does not.  The kernel writes
//     out[r] = sum over j with 0 <= dest[r][j] < slots of weights[r][j] * expert_out[dest[r][j]]
// in float32, zeros for rows without a local pair; slots no pair names (padding) are never read.
// Host-compilable (ops.cpp includes it): declarations only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep_comm {
namespace collective {

struct CombinePartialParams {
  const void* expert_out;  // [slots, hidden], dtype given to the launcher (protocol.h codes)
  const int64_t* dest;     // [rows, k] flat slots
  const float* weights;    // [rows, k]
  float* out;              // row r at out + (r / rows_per_chunk) * chunk_stride + (r % rows_per_chunk) * row_stride
  int64_t rows, k, hidden, slots;
  // the reduction buffer interleaves a header row after each destination's chunk: [world, n + 1, hidden]
  int64_t rows_per_chunk, chunk_stride, row_stride;  // elements
};

// Launches on ``stream`` (no synchronisation, no allocation: CUDA-graph capturable).  ``vectorised``
// needs hidden % 8 == 0 and 16-byte aligned rows of expert_out and out; otherwise pass false.
// Returns the launch error (cudaSuccess when nothing had to run).
cudaError_t launch_combine_partial(const CombinePartialParams& p, int in_dtype, bool vectorised, cudaStream_t stream);

}  // namespace collective
}  // namespace ep_comm
