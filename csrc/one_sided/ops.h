// The one-sided ops' implementations, compiled into ep_comm._C (namespace one_sided: ops mnnvl_*) and
// ep_comm._C_nvshmem (EP_COMM_NVSHMEM, namespace one_sided_nvshmem: ops nvshmem_*, put mode available).
// Ops launch on the current CUDA stream and never synchronise (CUDA graphs); their fake
// implementations for torch.compile live in ep_comm/backends/one_sided/ops.py.
#pragma once

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "common/op_utils.h"
#include "common/protocol.h"
#include "one_sided/one_sided.cuh"

namespace ep_comm {

namespace EP_KERNELS {

inline Common common(const at::Tensor& state, const at::Tensor& peer_base, const std::vector<int64_t>& cfg) {
  TORCH_CHECK(static_cast<int64_t>(cfg.size()) == kCfgLen, "ep_comm: config vector has ", cfg.size(),
              " entries, expected ", static_cast<int>(kCfgLen));
  TORCH_CHECK(state.is_cuda() && state.scalar_type() == at::kLong && state.is_contiguous(), "ep_comm: bad state");
  TORCH_CHECK(peer_base.is_cuda() && peer_base.scalar_type() == at::kLong, "ep_comm: bad peer table");
  Common c;
  c.lay = layout_from_cfg(cfg.data());
#ifndef EP_COMM_NVSHMEM
  TORCH_CHECK(c.lay.put == 0, "ep_comm: put mode needs the NVSHMEM build (ep_comm._C_nvshmem ops)");
#endif
  TORCH_CHECK(state.numel() * 2 >= 2 * kStateCounters + status_words(c.lay.world), "ep_comm: state too small");
  c.peer_base = peer_base.data_ptr<int64_t>();
  c.counters = reinterpret_cast<unsigned long long*>(state.data_ptr<int64_t>());
  c.status = reinterpret_cast<int32_t*>(state.data_ptr<int64_t>() + kStateCounters);
  return c;
}

using DispatchOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// What both halves of a dispatch derive from x and x_scales: row widths on the wire and how rows are
// split into pieces across warps.
struct RowShape {
  int64_t payload_bytes, scale_bytes, x_width, s_width;
  at::ScalarType x_type, s_type;
};

inline RowShape row_shape(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const std::vector<int64_t>& cfg) {
  const int64_t quant = cfg[kCfgQuant];
  const int64_t hidden = cfg[kCfgHidden];
  RowShape r{x.size(1) * x.element_size(), 0, x.size(1), 0, x.scalar_type(), at::kFloat};
  if (quant == kQuantFp8) {  // e4m3 bytes, a float32 scale per 128 channels
    r = RowShape{hidden, hidden / 128 * 4, hidden, hidden / 128, at::kFloat8_e4m3fn, at::kFloat};
  } else if (quant == kQuantNvfp4) {  // e2m1 pairs as uint8, an e4m3 scale per 16 channels (x_scales: the global scale)
    r = RowShape{hidden / 2, hidden / 16, hidden / 2, hidden / 16, at::kByte, at::kFloat8_e4m3fn};
  } else if (x_scales.has_value()) {
    r.s_width = x_scales->size(1);
    r.s_type = x_scales->scalar_type();
    r.scale_bytes = r.s_width * x_scales->element_size();
  }
  TORCH_CHECK(r.payload_bytes <= cfg[kCfgPayloadMax] && r.scale_bytes <= cfg[kCfgScaleMax],
              "ep_comm: row larger than the buffer");
  return r;
}

inline void set_dispatch_shape(DispatchParams& p, const RowShape& r, int64_t T, const std::vector<int64_t>& cfg,
                        at::Tensor& work) {
  const Layout& L = p.c.lay;
  const int64_t k = L.top_k;
  p.payload_bytes = r.payload_bytes;
  p.scale_bytes = r.scale_bytes;
  p.num_tokens = static_cast<int>(T);
  // split rows so that every warp of the grid has a piece to send (latency of small batches)
  const int64_t warps = cfg[kCfgNumBlocks] * kWarps;
  // (quantised rows: pieces of 256 channels, whole scale blocks each; NVFP4 packs them into 128 bytes)
  const int64_t unit = cfg[kCfgQuant] == kQuantFp8 ? 256 : cfg[kCfgQuant] == kQuantNvfp4 ? 128 : 512;
  int64_t chunks = T > 0 ? std::max<int64_t>(1, std::min<int64_t>(warps / T, (p.payload_bytes + unit - 1) / unit)) : 1;
  p.chunk_bytes = ((p.payload_bytes + chunks - 1) / chunks + unit - 1) / unit * unit;
  p.chunks = static_cast<int>((p.payload_bytes + p.chunk_bytes - 1) / p.chunk_bytes);
  p.capacity = static_cast<int64_t>(L.world) * L.max_tokens;
  TORCH_CHECK(work.is_cuda() && work.scalar_type() == at::kInt &&
                  work.numel() >= static_cast<int64_t>(L.world) * L.num_local + static_cast<int64_t>(L.max_tokens) * (k + 1),
              "ep_comm: bad dispatch workspace");
  p.send_count = work.data_ptr<int32_t>();
  p.self_slot = p.send_count + static_cast<int64_t>(L.world) * L.num_local;
  p.self_ready = reinterpret_cast<uint32_t*>(p.self_slot + static_cast<int64_t>(L.max_tokens) * k);
}

inline void set_dispatch_outputs(DispatchParams& p, at::Tensor& out_x, at::Tensor& out_s, at::Tensor& row_ids,
                          at::Tensor& row_w, at::Tensor& row_slot, at::Tensor& counts) {
  const bool batched = p.c.lay.batched != 0;
  p.out_x = out_x.data_ptr();
  p.out_scales = p.scale_bytes ? out_s.data_ptr() : nullptr;
  p.row_ids = row_ids.data_ptr<int32_t>();
  p.row_w = row_w.data_ptr<float>();
  p.row_slot = batched ? row_slot.data_ptr<int32_t>() : nullptr;
  p.counts = batched ? counts.data_ptr<int32_t>() : nullptr;
  // decode-sized pieces are laid out from one round of loads (dispatch_receive.cuh, lay_out_prefetched):
  // every piece, its places and the scales 16-byte aligned, the scales one vector a lane
  const Layout& L = p.c.lay;
  const uint64_t bits = static_cast<uint64_t>(p.chunk_bytes | p.payload_bytes | p.scale_bytes | L.payload_offset |
                                              L.scale_offset) |
                        reinterpret_cast<uintptr_t>(p.out_x) | reinterpret_cast<uintptr_t>(p.out_scales);
  p.prefetch_pieces = p.chunk_bytes <= kPrefetchPieceBytes && p.scale_bytes <= kPrefetchScaleBytes && (bits & 15) == 0;
}

inline int phases_arg(int64_t phases) {
  const int64_t halves = phases & ~static_cast<int64_t>(kPhaseChecked);
  TORCH_CHECK(halves == kPhaseSend || halves == kPhaseBoth,
              "ep_comm: phases must be send (1) or both (3), plus 4 after an input verdict");
  return static_cast<int>(halves);
}

inline DispatchOut kernel_dispatch(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const c10::optional<at::Tensor>& x_scales, at::Tensor& state, at::Tensor& work,
                           const at::Tensor& peer_base, const at::Tensor& expert_owner, std::vector<int64_t> cfg,
                           int64_t phases) {
  const c10::cuda::CUDAGuard guard(x.device());
  DispatchParams p{};
  p.c = common(state, peer_base, cfg);
  p.phases = phases_arg(phases);
  p.checked = (phases & kPhaseChecked) != 0;
  const Layout& L = p.c.lay;
  const int64_t T = x.size(0);
  const int64_t k = L.top_k;
  const int64_t N = static_cast<int64_t>(L.world) * L.max_tokens;
  TORCH_CHECK(T <= L.max_tokens && topk_ids.size(0) == T && topk_ids.size(1) == k, "ep_comm: bad dispatch shapes");
  at::Tensor xc = aligned_rows(x), ids = topk_ids.contiguous(), w = topk_weights.contiguous();
  const int64_t quant = cfg[kCfgQuant];
  // carried scales travel with the rows; NVFP4's x_scales is the global scale the kernel quantises with
  at::Tensor sc = x_scales.has_value() && quant == kQuantNone ? aligned(*x_scales) : at::Tensor();
  at::Tensor gs;
  if (quant == kQuantNvfp4) {
    TORCH_CHECK(x_scales.has_value() && x_scales->numel() == 1 && x_scales->scalar_type() == at::kFloat &&
                    x_scales->device() == x.device(),
                "ep_comm: quant='nvfp4' takes the global scale as x_scales: float32, one element, on x's device");
    gs = x_scales->reshape({1});
  }
  const RowShape r = row_shape(x, x_scales, cfg);
  set_dispatch_shape(p, r, T, cfg, work);
  // receive while sending where the receive is a copy of whole rows that can run beside the sends: the
  // standard layout's copy or the batched layout's expansion into expert slots (taken in the order rows
  // land), of bf16 rows or fp8 quantised from bf16 (the overlap kernel keeps its token counts after the
  // quantiser's stages), peers' memory mapped, one launch, and enough tokens that every warp
  // sends whole rows (p.chunks == 1: prefill sizes; a decode call keeps every warp on its sends).  How
  // many warps of each block receive is the config's (Cfg.RECEIVE_WARPS: by world size and quant, 0 where
  // receiving while sending does not pay; ep_comm/backends/one_sided/layout.py)
  const bool fp8_from_bf16 = cfg[kCfgQuant] == kQuantFp8 && x.scalar_type() == at::kBFloat16;
  const bool whole_rows = p.chunks == 1 && (cfg[kCfgQuant] == kQuantNone || fp8_from_bf16);
  const bool one_launch_mapped = p.phases == kPhaseBoth && L.put == 0 && !L.zero_copy;
  const int64_t receive_warps = cfg[kCfgReceiveWarps];
  TORCH_CHECK(receive_warps >= 0 && receive_warps < kWarps, "ep_comm: Cfg.RECEIVE_WARPS out of range");
  p.receive_warps = whole_rows && one_launch_mapped && L.world > 1 ? static_cast<int>(receive_warps) : 0;
  const auto opts = x.options();
  at::Tensor out_x, out_s;
  if (L.batched) {
    out_x = at::empty({L.num_local, N, r.x_width}, opts.dtype(r.x_type));
    out_s = r.scale_bytes ? at::empty({L.num_local, N, r.s_width}, opts.dtype(r.s_type)) : at::empty({0}, opts.dtype(r.s_type));
  } else {
    // zero copy: the rows stay in the receive buffer, which the host views (no output rows here)
    const int64_t rows = L.zero_copy ? 0 : N;
    out_x = at::empty({rows, r.x_width}, opts.dtype(r.x_type));
    out_s = r.scale_bytes ? at::empty({rows, r.s_width}, opts.dtype(r.s_type)) : at::empty({0}, opts.dtype(r.s_type));
  }
  at::Tensor row_ids = at::empty({N, k}, opts.dtype(at::kInt));
  at::Tensor row_w = at::empty({N, k}, opts.dtype(at::kFloat));
  at::Tensor row_slot = at::empty({L.batched ? N : 0, k}, opts.dtype(at::kInt));
  at::Tensor counts = at::empty({L.batched ? L.num_local : 0}, opts.dtype(at::kInt));
  at::Tensor dest = at::empty({T, k}, opts.dtype(at::kInt));

  p.expert_owner = expert_owner.data_ptr<int32_t>();
  p.x = xc.data_ptr();
  p.x_row_bytes = row_pitch_bytes(xc);
  p.ids = ids.data_ptr();
  p.weights = w.data_ptr<float>();
  p.x_scales = sc.defined() ? sc.data_ptr() : nullptr;
  p.global_scale = gs.defined() ? gs.data_ptr<float>() : nullptr;
  set_dispatch_outputs(p, out_x, out_s, row_ids, row_w, row_slot, counts);
  p.dest = dest.data_ptr<int32_t>();
  const int quant_dtype = quant == kQuantFp8     ? dtype_code(x.scalar_type())
                          : quant == kQuantNvfp4 ? kDispatchNvfp4 + dtype_code(x.scalar_type())
                                                 : -1;
  EP_CUDA_CHECK(launch_dispatch(p, quant_dtype, ids.scalar_type() == at::kLong,
                                       static_cast<int>(cfg[kCfgNumBlocks]), c10::cuda::getCurrentCUDAStream()));
  return DispatchOut{out_x, out_s, row_ids, row_w, row_slot, counts, dest};
}

// The receive half of a dispatch launched with phases = send (return_recv_hook): same x / x_scales
// (for the row widths and T), the outputs that call returned.
inline void kernel_dispatch_recv(const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, at::Tensor& state,
                         at::Tensor& work, const at::Tensor& peer_base, at::Tensor& out_x, at::Tensor& out_s,
                         at::Tensor& row_ids, at::Tensor& row_w, at::Tensor& row_slot, at::Tensor& counts,
                         std::vector<int64_t> cfg) {
  const c10::cuda::CUDAGuard guard(x.device());
  DispatchParams p{};
  p.c = common(state, peer_base, cfg);
  p.phases = kPhaseReceive;
  TORCH_CHECK(x.size(0) <= p.c.lay.max_tokens, "ep_comm: bad dispatch shapes");
  set_dispatch_shape(p, row_shape(x, x_scales, cfg), x.size(0), cfg, work);
  set_dispatch_outputs(p, out_x, out_s, row_ids, row_w, row_slot, counts);
  // the receive half reads no input; the ids' width only selects the kernel instance
  EP_CUDA_CHECK(launch_dispatch(p, -1, false, static_cast<int>(cfg[kCfgNumBlocks]),
                                       c10::cuda::getCurrentCUDAStream()));
}

inline void kernel_combine(const at::Tensor& expert_out, const at::Tensor& row_ids, const at::Tensor& row_w,
                   const at::Tensor& row_slot, const at::Tensor& dest, at::Tensor& state, const at::Tensor& peer_base,
                   at::Tensor& out, std::vector<int64_t> cfg, int64_t phases) {
  const c10::cuda::CUDAGuard guard(expert_out.device());
  CombineParams p{};
  p.c = common(state, peer_base, cfg);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype_of(cfg[kCfgOutDtype]) && out.size(0) == dest.size(0),
              "ep_comm: bad combine output");
  at::Tensor eo = aligned(expert_out);
  p.expert_out = eo.data_ptr();
  p.pull = cfg[kCfgCombinePullInput] != 0;
  // pull: peers read the rows at the address they were given, so the op must be handed exactly those
  TORCH_CHECK(!p.pull || (reinterpret_cast<uintptr_t>(p.expert_out) == static_cast<uintptr_t>(cfg[kCfgCombinePullInput]) &&
                          eo.scalar_type() == dtype_of(cfg[kCfgOutDtype]) && !p.c.lay.batched),
              "ep_comm: a pulling combine reads its expert_out from the communicator's buffer");
  p.row_ids = row_ids.data_ptr<int32_t>();
  p.row_w = row_w.data_ptr<float>();
  p.row_slot = row_slot.numel() ? row_slot.data_ptr<int32_t>() : nullptr;
  p.dest = dest.data_ptr<int32_t>();
  p.num_tokens = static_cast<int>(dest.size(0));
  // split rows so that every warp of the grid has a piece (latency of small batches)
  const int64_t H = p.c.lay.hidden;
  const int64_t warps = cfg[kCfgNumBlocks] * kWarps;
  // (push: rows sent to peers, the own rows are summed at the receive end; pull: own tokens' rows)
  const int64_t rows = p.pull ? std::max<int64_t>(1, p.num_tokens)
                              : std::max<int64_t>(1, static_cast<int64_t>(std::max(1, p.c.lay.world - 1)) * p.c.lay.max_tokens);
  int64_t chunks = H % 8 == 0 ? std::max<int64_t>(1, std::min<int64_t>((warps + rows - 1) / rows, (H + 255) / 256)) : 1;
  p.chunk_elems = static_cast<int>(chunks == 1 ? H : ((H + chunks - 1) / chunks + 255) / 256 * 256);
  p.chunks = static_cast<int>((H + p.chunk_elems - 1) / p.chunk_elems);
  p.out = out.data_ptr();
  p.grouped = static_cast<int>(cfg[kCfgCombineGrouped]);
  TORCH_CHECK(phases >= kPhaseSend && phases <= kPhaseBoth, "ep_comm: bad combine phases ", phases);
  p.phases = static_cast<int>(phases);
  // the interleaved grouped combine's summing warps (Cfg.COMBINE_SUM_WARPS, layout.py); a hooked call
  // splits by halves instead (its send half only sends, its receive half only sums)
  const int64_t sum_warps = cfg[kCfgCombineSumWarps];
  TORCH_CHECK(sum_warps >= 0 && sum_warps < kWarps, "ep_comm: Cfg.COMBINE_SUM_WARPS out of range");
  p.sum_warps = p.grouped == 1 && p.phases == kPhaseBoth && !p.pull ? static_cast<int>(sum_warps) : 0;
  EP_CUDA_CHECK(launch_combine(p, dtype_code(eo.scalar_type()), static_cast<int>(cfg[kCfgOutDtype]),
                                      static_cast<int>(cfg[kCfgNumBlocks]), c10::cuda::getCurrentCUDAStream()));
}

inline void kernel_abort(at::Tensor& state, const at::Tensor& peer_base, std::vector<int64_t> cfg, int64_t calls) {
  TORCH_CHECK(calls == 1 || calls == 2, "ep_comm: an abort gives up 1 (combine) or 2 (dispatch) calls, not ", calls);
  const c10::cuda::CUDAGuard guard(state.device());
  const Common c = common(state, peer_base, cfg);
  EP_CUDA_CHECK(launch_abort(c, static_cast<int>(calls), c10::cuda::getCurrentCUDAStream()));
}

// The input verdict queued in front of a checked dispatch: ``topk_ids`` range-checked (none: this
// rank's input was refused by the host, ``own_bad`` says so), exchanged with every rank.
inline void kernel_verdict(const c10::optional<at::Tensor>& topk_ids, int64_t own_bad, bool advance, at::Tensor& state,
                           const at::Tensor& peer_base, std::vector<int64_t> cfg) {
  const c10::cuda::CUDAGuard guard(state.device());
  const Common c = common(state, peer_base, cfg);
  at::Tensor ids = topk_ids.has_value() ? topk_ids->contiguous() : at::Tensor();
  TORCH_CHECK(!ids.defined() || ((ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong) && ids.is_cuda()),
              "ep_comm: topk_ids must be int32 or int64 on the device");
  const int64_t n = ids.defined() ? ids.numel() : 0;
  EP_CUDA_CHECK(launch_verdict(c, n ? ids.data_ptr() : nullptr, ids.defined() && ids.scalar_type() == at::kLong, n,
                               static_cast<int>(own_bad), advance, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace EP_KERNELS
}  // namespace ep_comm

// Schemas and CUDA implementations of one kernel backend's ops, named <prefix>_dispatch etc.
#define EP_KERNEL_OP_SCHEMAS(m, P)                                                                              \
  m.def(P "_dispatch(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor? x_scales, Tensor(a!) state, "     \
          "Tensor(b!) work, Tensor peer_base, Tensor expert_owner, int[] cfg, int phases=3) -> "                \
          "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");                                          \
  m.def(P "_combine(Tensor expert_out, Tensor row_ids, Tensor row_w, Tensor row_slot, Tensor dest, "            \
          "Tensor(a!) state, Tensor peer_base, Tensor(b!) out, int[] cfg, int phases=3) -> ()");                \
  m.def(P "_dispatch_recv(Tensor x, Tensor? x_scales, Tensor(a!) state, Tensor(b!) work, Tensor peer_base, "    \
          "Tensor(c!) out_x, Tensor(d!) out_scales, Tensor(e!) row_ids, Tensor(f!) row_w, Tensor(g!) row_slot, " \
          "Tensor(h!) counts, int[] cfg) -> ()");                                                               \
  m.def(P "_abort(Tensor(a!) state, Tensor peer_base, int[] cfg, int calls=1) -> ()");                                      \
  m.def(P "_verdict(Tensor? topk_ids, int own_bad, bool advance, Tensor(a!) state, Tensor peer_base, "          \
          "int[] cfg) -> ()")

#define EP_KERNEL_OP_IMPLS(m, P)                                      \
  m.impl(P "_dispatch", &ep_comm::EP_KERNELS::kernel_dispatch);       \
  m.impl(P "_combine", &ep_comm::EP_KERNELS::kernel_combine);         \
  m.impl(P "_dispatch_recv", &ep_comm::EP_KERNELS::kernel_dispatch_recv); \
  m.impl(P "_abort", &ep_comm::EP_KERNELS::kernel_abort);             \
  m.impl(P "_verdict", &ep_comm::EP_KERNELS::kernel_verdict)
