// The collective backends' (naive, ag_rs) ops: host wrappers of the kernels in this folder, registered
// by csrc/ops.cpp as ep_comm::collective_*.  They launch on the current stream and never synchronise.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "collective/combine_partial.h"
#include "collective/select_local.h"
#include "common/op_utils.h"

namespace ep_comm {
namespace collective {

// ep_comm::collective_combine_partial: the float32 partial rows of a batched combine of naive/ag_rs
// (csrc/collective/combine_partial.h).  ``out`` is [rows, hidden] or the [world, rows / world, hidden]
// view of the reduction buffer that skips its header rows; it is fully overwritten.
inline void collective_combine_partial(const at::Tensor& expert_out, const at::Tensor& dest, const at::Tensor& weights,
                                at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(expert_out.device());
  TORCH_CHECK(expert_out.is_cuda() && dest.is_cuda() && weights.is_cuda() && out.is_cuda(),
              "ep_comm: collective_combine_partial needs CUDA tensors");
  TORCH_CHECK(expert_out.dim() == 2, "ep_comm: expert_out must be [slots, hidden]");
  TORCH_CHECK(dest.scalar_type() == at::kLong && dest.dim() == 2, "ep_comm: dest must be int64 [rows, k]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.sizes() == dest.sizes(),
              "ep_comm: weights must be float32 shaped like dest");
  TORCH_CHECK(out.scalar_type() == at::kFloat && (out.dim() == 2 || out.dim() == 3) && out.stride(-1) == 1,
              "ep_comm: out must be float32 [rows, hidden] or [chunks, rows / chunks, hidden], rows contiguous");
  const int64_t hidden = expert_out.size(1);
  const int64_t rows = dest.size(0);
  TORCH_CHECK(out.size(-1) == hidden, "ep_comm: out has width ", out.size(-1), ", expert_out ", hidden);
  const int64_t per_chunk = out.dim() == 3 ? out.size(1) : out.size(0);
  const int64_t out_rows = out.dim() == 3 ? out.size(0) * per_chunk : per_chunk;
  TORCH_CHECK(out_rows == rows, "ep_comm: out has ", out_rows, " rows, dest ", rows);
  if (rows == 0 || hidden == 0) return;
  const at::Tensor eo = expert_out.contiguous(), d = dest.contiguous(), w = weights.contiguous();
  collective::CombinePartialParams p{};
  p.expert_out = eo.data_ptr();
  p.dest = d.data_ptr<int64_t>();
  p.weights = w.data_ptr<float>();
  p.out = out.data_ptr<float>();
  p.rows = rows;
  p.k = dest.size(1);
  p.hidden = hidden;
  p.slots = eo.size(0);
  p.rows_per_chunk = per_chunk;
  p.row_stride = out.dim() == 3 ? out.stride(1) : out.stride(0);
  p.chunk_stride = out.dim() == 3 ? out.stride(0) : 0;
  // 16-byte vectors only where every row starts 16-byte aligned; other shapes take the scalar kernel
  const bool vectorised = hidden % 8 == 0 && reinterpret_cast<uintptr_t>(p.expert_out) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && p.row_stride % 4 == 0 &&
                          p.chunk_stride % 4 == 0;
  EP_CUDA_CHECK(collective::launch_combine_partial(p, dtype_code(eo.scalar_type()), vectorised,
                                                   c10::cuda::getCurrentCUDAStream()));
}

// The [rows, k] rows of a gathered ids/weights table, given as [rows, k] or as the [chunks, rows / chunks, k]
// strided view of the gathered buffer: (rows per chunk, chunk stride, row stride) in elements.
inline std::tuple<int64_t, int64_t, int64_t> row_geometry(const at::Tensor& t, const char* what) {
  TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1, "ep_comm: ", what,
              " must be [rows, k] or [chunks, rows / chunks, k] with contiguous rows");
  if (t.dim() == 3) return {t.size(1), t.stride(0), t.stride(1)};
  return {std::max<int64_t>(t.size(0), 1), 0, t.stride(0)};
}

// ep_comm::collective_select_local (csrc/collective/select_local.h).  counts (and dest) empty: standard layout.
inline void collective_select_local(const at::Tensor& ids, const at::Tensor& weights, int64_t rank, int64_t num_local,
                             int64_t capacity, at::Tensor& local_ids, at::Tensor& local_w, at::Tensor& row_valid,
                             at::Tensor& dest, at::Tensor& counts) {
  const c10::cuda::CUDAGuard guard(ids.device());
  TORCH_CHECK(ids.is_cuda() && weights.is_cuda() && local_ids.is_cuda() && local_w.is_cuda() && row_valid.is_cuda() &&
              dest.is_cuda() && counts.is_cuda(), "ep_comm: collective_select_local needs CUDA tensors");
  TORCH_CHECK(ids.scalar_type() == at::kInt && weights.scalar_type() == at::kFloat && ids.sizes() == weights.sizes(),
              "ep_comm: ids must be int32 and weights float32 of one shape");
  const int64_t k = ids.size(-1);
  const int64_t rows = ids.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(local_ids.scalar_type() == at::kInt && local_ids.is_contiguous() && local_ids.numel() == rows * k &&
              local_w.scalar_type() == at::kFloat && local_w.is_contiguous() && local_w.numel() == rows * k &&
              row_valid.scalar_type() == at::kBool && row_valid.is_contiguous() && row_valid.numel() == rows,
              "ep_comm: local_ids int32 / local_w float32 [rows, k] and row_valid bool [rows], contiguous");
  const bool batched = counts.numel() > 0;  // not dest: it is empty in a batched call without rows too
  TORCH_CHECK(!batched || (dest.scalar_type() == at::kLong && dest.is_contiguous() && dest.numel() == rows * k &&
                           counts.scalar_type() == at::kInt && counts.is_contiguous() && counts.numel() == num_local),
              "ep_comm: dest int64 [rows, k] and counts int32 [num_local], contiguous (or both empty)");
  TORCH_CHECK(num_local > 0 && capacity >= 0 && rank >= 0, "ep_comm: bad num_local / capacity / rank");
  collective::SelectLocalParams p{};
  p.ids = ids.data_ptr<int32_t>();
  p.weights = weights.data_ptr<float>();
  p.rows = rows;
  p.k = k;
  std::tie(p.rows_per_chunk, p.ids_chunk_stride, p.ids_row_stride) = row_geometry(ids, "ids");
  int64_t w_per_chunk = 0;
  std::tie(w_per_chunk, p.w_chunk_stride, p.w_row_stride) = row_geometry(weights, "weights");
  TORCH_CHECK(w_per_chunk == p.rows_per_chunk, "ep_comm: ids and weights are chunked differently");
  p.rank = static_cast<int32_t>(rank);
  p.num_local = static_cast<int32_t>(num_local);
  p.capacity = capacity;
  p.local_ids = local_ids.data_ptr<int32_t>();
  p.local_w = local_w.data_ptr<float>();
  p.row_valid = row_valid.data_ptr<bool>();
  p.dest = batched ? dest.data_ptr<int64_t>() : nullptr;
  p.counts = batched ? counts.data_ptr<int32_t>() : nullptr;
  EP_CUDA_CHECK(collective::launch_select_local(p, c10::cuda::getCurrentCUDAStream()));
}

// ep_comm::collective_scatter_rows: out[dest[r][j]] = src[r] for every dest in [0, out rows).
inline void collective_scatter_rows(const at::Tensor& src, const at::Tensor& dest, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(src.device());
  TORCH_CHECK(src.is_cuda() && dest.is_cuda() && out.is_cuda(), "ep_comm: collective_scatter_rows needs CUDA tensors");
  TORCH_CHECK(src.scalar_type() == at::kByte && src.dim() == 2 && src.stride(1) == 1,
              "ep_comm: src must be uint8 [rows, row_bytes] with contiguous rows");
  TORCH_CHECK(dest.scalar_type() == at::kLong && dest.dim() == 2 && dest.is_contiguous() && dest.size(0) == src.size(0),
              "ep_comm: dest must be int64 [rows, k], contiguous, one row per src row");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 2 && out.is_contiguous() && out.size(1) == src.size(1),
              "ep_comm: out must be uint8 [slots, row_bytes], contiguous");
  collective::ScatterRowsParams p{};
  p.src = src.data_ptr<uint8_t>();
  p.rows = src.size(0);
  p.row_bytes = src.size(1);
  p.src_stride = src.stride(0);
  p.dest = dest.data_ptr<int64_t>();
  p.k = dest.size(1);
  p.slots = out.size(0);
  p.out = out.data_ptr<uint8_t>();
  const bool vectorised = p.row_bytes % 16 == 0 && p.src_stride % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(p.src) % 16 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  EP_CUDA_CHECK(collective::launch_scatter_rows(p, vectorised, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace collective
}  // namespace ep_comm
