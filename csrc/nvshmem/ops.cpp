// ep_comm._C_nvshmem: the nvshmem backend's ops (nvshmem_dispatch, nvshmem_combine,
// nvshmem_dispatch_recv, nvshmem_abort): the one-sided op implementations over the kernels compiled
// for this extension (EP_COMM_NVSHMEM), which also run in put mode.  Same schemas as the mnnvl_* ops.
#include "one_sided/ops.h"

TORCH_LIBRARY_FRAGMENT(ep_comm, m) { EP_KERNEL_OP_SCHEMAS(m, "nvshmem"); }

TORCH_LIBRARY_IMPL(ep_comm, CUDA, m) { EP_KERNEL_OP_IMPLS(m, "nvshmem"); }
