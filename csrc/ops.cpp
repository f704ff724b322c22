// ep_comm._C: torch.library registration of the one-sided ops over mapped buffers (mnnvl_*, in
// one_sided/ops.h), the collective backends' ops (collective/ops.h) and the
// host-mapped arena.  Ops launch on the current CUDA stream and never synchronise, so they run under
// CUDA-graph capture; torch.compile traces them through the fake implementations registered by
// ep_comm/backends/one_sided/ops.py and ep_comm/backends/collective/kernels.py.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

#include "collective/ops.h"
#include "common/op_utils.h"
#include "common/protocol.h"
#include "one_sided/ops.h"

namespace ep_comm {
namespace {

// One page-locked, device-mapped arena per process for the host-visible error words of every
// communicator (ep_comm/backends/one_sided/device.py hands out slots).  It is never freed: freeing
// page-locked memory is not allowed while any stream captures a CUDA graph, and a communicator
// can be garbage-collected at any time.
constexpr int64_t kArenaWords = 1 << 14;

std::tuple<at::Tensor, int64_t> mapped_arena() {
  static void* host = nullptr;
  static void* dev = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    EP_CUDA_CHECK(cudaHostAlloc(&host, kArenaWords * sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host, 0, kArenaWords * sizeof(int32_t));
    EP_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
  });
  TORCH_CHECK(host != nullptr && dev != nullptr, "ep_comm: the host-mapped arena could not be allocated");
  at::Tensor t = torch::from_blob(host, {kArenaWords}, [](void*) {}, at::TensorOptions().dtype(at::kInt));
  return {t, static_cast<int64_t>(reinterpret_cast<uintptr_t>(dev))};
}

}  // namespace
}  // namespace ep_comm

TORCH_LIBRARY(ep_comm, m) {
  EP_KERNEL_OP_SCHEMAS(m, "mnnvl");
  m.def("collective_combine_partial(Tensor expert_out, Tensor dest, Tensor weights, Tensor(a!) out) -> ()");
  m.def("collective_select_local(Tensor ids, Tensor weights, int rank, int num_local, int capacity, Tensor(a!) local_ids, "
        "Tensor(b!) local_w, Tensor(c!) row_valid, Tensor(d!) dest, Tensor(e!) counts) -> ()");
  m.def("collective_scatter_rows(Tensor src, Tensor dest, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(ep_comm, CUDA, m) {
  EP_KERNEL_OP_IMPLS(m, "mnnvl");
  m.impl("collective_combine_partial", &ep_comm::collective::collective_combine_partial);
  m.impl("collective_select_local", &ep_comm::collective::collective_select_local);
  m.impl("collective_scatter_rows", &ep_comm::collective::collective_scatter_rows);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ep_comm CUDA kernels (ops registered under torch.ops.ep_comm)";
  m.def("mapped_arena", &ep_comm::mapped_arena, "the process's host-mapped int32 arena: (cpu tensor, device address)");
  m.attr("PROTOCOL_FINGERPRINT") = static_cast<int64_t>(ep_comm::kProtocolFingerprint);
}
