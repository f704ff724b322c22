// Device helpers the mnnvl kernels share (peer pointers, call flags, signalling, phase stamps).
// Included by dispatch.cu and combine.cu; everything here has internal linkage.
#pragma once

#include "common/device.cuh"
#include "mnnvl/mnnvl.cuh"

namespace ep_comm {
namespace mnnvl {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint8_t* peer_ptr(const Common& c, int r) {
  return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(c.peer_base[r]));
}

__device__ __forceinline__ uint64_t* flag_slot(const Common& c, int owner, int parity, int src) {
  return reinterpret_cast<uint64_t*>(peer_ptr(c, owner) + c.lay.flags_offset) + parity * c.lay.world + src;
}

// The call a kernel belongs to, from the device-side call counter: its number, flag code and buffer
// parity.  A receive half runs right after its send half (the host refuses other calls in between),
// which already advanced the counter.
struct CallId {
  uint64_t seq;
  uint32_t code;
  int parity;
};

__device__ __forceinline__ CallId current_call(const Common& c, uint32_t op, int phases) {
  const uint64_t seq = *reinterpret_cast<volatile unsigned long long*>(c.counters + kStateSeq) -
                       (phases == kPhaseReceive ? 1 : 0);
  return CallId{seq, make_code(seq, op), static_cast<int>(seq & 1)};
}

__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }

// Phase stamp of this block when tracing is on (EP_COMM_TRACE=1); with ``sync`` the whole block
// reaches the point first.  The condition is uniform over the grid, so the barrier is safe.
__device__ __forceinline__ void stamp(const Layout& L, int op, int slot, bool sync = false) {
  if (L.trace == nullptr) return;
  if (sync) __syncthreads();
  if (threadIdx.x == 0)
    L.trace[(static_cast<int64_t>(op) * gridDim.x + blockIdx.x) * kTraceSlots + slot] = global_timer_ns();
}

// Signal every peer (and this rank) that this launch's sends are complete.  Called by the last
// block to arrive; each thread releases its own flag so the NVLink round trips overlap.
__device__ __forceinline__ void signal_all(const Common& c, int parity, uint64_t value) {
  for (int peer = threadIdx.x; peer < c.lay.world; peer += blockDim.x)
    st_release_sys(flag_slot(c, peer, parity, c.lay.rank), value);
}

}  // namespace
}  // namespace mnnvl
}  // namespace ep_comm
