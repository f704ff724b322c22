// ep_comm._C_nvshmem's NVSHMEM host runtime (ep_comm/memory/nvshmem_heap.py): start/join, heap,
// peer addresses, finalise.
//
// Built by setup.py only where the NVSHMEM wheel (nvidia-nvshmem-cu12/13) is installed, and linked
// against that wheel's libnvshmem_host.so.3, the copy `import torch` already loads, so the process
// holds one NVSHMEM.  The extension also carries device code (the kernels' put mode, -rdc with
// libnvshmem_device.a), so it starts NVSHMEM through nvshmemi_init_thread, which registers this
// module's device state with the host library; the header's nvshmem_init()/nvshmemx_init_attr() wrap
// the same call but exit() on failure, which a library must never do.  A second call on a running
// NVSHMEM only registers the device state and counts a reference; nvshmemi_finalize drops it.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "common/protocol.h"
#include "host/nvshmem_api.h"
#include "host/nvshmemx_api.h"

namespace py = pybind11;

namespace {

nvshmemi_version_t library_version() {
  return nvshmemi_version_t{NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
}

py::bytes unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int rc = nvshmemx_get_uniqueid(&id);
  if (rc != 0) throw std::runtime_error("nvshmemx_get_uniqueid failed with status " + std::to_string(rc));
  return py::bytes(reinterpret_cast<const char*>(&id), sizeof(id));
}

// Joins (and, with the other ranks, starts) NVSHMEM as PE `rank` of `world`; returns NVSHMEM's status
// (0: success).  The GIL is released: the call blocks until every PE has joined.
int init(const std::string& uid, int rank, int world) {
  if (uid.size() != sizeof(nvshmemx_uniqueid_t))
    throw std::invalid_argument("unique id has " + std::to_string(uid.size()) + " bytes, expected " +
                                std::to_string(sizeof(nvshmemx_uniqueid_t)));
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, uid.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  py::gil_scoped_release release;
  int rc = nvshmemx_set_attr_uniqueid_args(rank, world, &id, &attr);
  if (rc != 0) return rc;
  int provided = 0;
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr,
                              library_version());
}

// An NVSHMEM someone else started (torch symmetric memory, the engine): register this module's
// device state and take a reference.
int attach() {
  py::gil_scoped_release release;
  int provided = 0;
  return nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, library_version());
}

// Collective: every PE allocates the same size.  0 when the symmetric heap is too small.
int64_t heap_malloc(int64_t nbytes) {
  py::gil_scoped_release release;
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(nvshmem_malloc(static_cast<size_t>(nbytes))));
}

void heap_free(int64_t ptr) {
  py::gil_scoped_release release;
  nvshmem_free(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)));
}

// This process's address of `pe`'s copy of the symmetric object at `ptr`, or 0 when `pe` cannot be
// reached by loads and stores (another host without NVLink mapping, or P2P off).
int64_t peer_ptr(int64_t ptr, int pe) {
  return static_cast<int64_t>(
      reinterpret_cast<uintptr_t>(nvshmem_ptr(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr)), pe)));
}

void barrier_all() {
  py::gil_scoped_release release;
  nvshmem_barrier_all();
}

// Drops this module's reference (the last one finalises NVSHMEM; collective then).
void finalize() {
  py::gil_scoped_release release;
  nvshmemi_finalize();
}

}  // namespace

PYBIND11_MODULE(_C_nvshmem, m) {
  m.doc() = "NVSHMEM host runtime of ep_comm's nvshmem backend";
  m.def("unique_id", &unique_id, "a new NVSHMEM unique id (bytes), to broadcast from rank 0");
  m.def("init", &init, py::arg("uid"), py::arg("rank"), py::arg("world"),
        "join NVSHMEM as PE rank of world with the unique id; returns NVSHMEM's status (0: ok)");
  m.def("attach", &attach, "join an NVSHMEM started elsewhere (registers this module); returns the status");
  m.def("init_status", [] { return nvshmemx_init_status(); }, "nvshmemx_init_status()");
  m.def("my_pe", [] { return nvshmem_my_pe(); });
  m.def("n_pes", [] { return nvshmem_n_pes(); });
  m.def("malloc", &heap_malloc, py::arg("nbytes"), "collective nvshmem_malloc; 0 when the heap is exhausted");
  m.def("free", &heap_free, py::arg("ptr"), "collective nvshmem_free");
  m.def("ptr", &peer_ptr, py::arg("ptr"), py::arg("pe"), "nvshmem_ptr: peer address or 0");
  m.def("barrier_all", &barrier_all);
  m.def("finalize", &finalize, "drop this module's NVSHMEM reference (nvshmemi_finalize)");
  m.attr("PROTOCOL_FINGERPRINT") = static_cast<int64_t>(ep_comm::kProtocolFingerprint);
  m.attr("STATUS_IS_INITIALIZED") = static_cast<int>(NVSHMEM_STATUS_IS_INITIALIZED);
  m.attr("VERSION") = std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." + std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) +
                      "." + std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}
