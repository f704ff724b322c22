// Device helpers the one-sided kernels share (peer pointers, call flags, signalling, phase stamps).
// Included by dispatch.cu and combine.cu; everything here has internal linkage.
#pragma once

#include "common/device.cuh"
#include "one_sided/one_sided.cuh"

#ifdef EP_COMM_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

namespace ep_comm {
namespace EP_KERNELS {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// After a shrink the ranks that left are neither signalled nor waited for; no token is routed to
// them (their experts' owner entries are negative).
__device__ __forceinline__ bool peer_active(const Layout& L, int r) { return L.active == nullptr || L.active[r] != 0; }

__device__ __forceinline__ uint8_t* peer_ptr(const Common& c, int r) {
  return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(c.peer_base[r]));
}

// The flags region holds rows of [world] words: rows 0 and 1 are the call flags of each parity,
// rows kVerdictRows + parity the input verdicts (verdict_kernel).  ``row``: which of them.
constexpr int kVerdictRows = 2;

__device__ __forceinline__ uint64_t* flag_slot(const Common& c, int owner, int row, int src) {
  return reinterpret_cast<uint64_t*>(peer_ptr(c, owner) + c.lay.flags_offset) + row * c.lay.world + src;
}

// ---- put mode (one_sided.cuh): the compiler drops all of it outside the NVSHMEM build ----------------------
__host__ __device__ __forceinline__ bool put_mode(const Layout& L) {
#ifdef EP_COMM_NVSHMEM
  return L.put != 0;
#else
  return false;
#endif
}

// This rank's address of the symmetric object at byte ``off`` of the buffer (what NVSHMEM calls take
// for the peer's copy at the same offset).
__device__ __forceinline__ uint8_t* own_at(const Common& c, int64_t off) { return peer_ptr(c, c.lay.rank) + off; }

// Bytes [off, off + n) of this rank's buffer (staged there) to the same offset of rank ``pe``'s buffer;
// one warp, non-blocking: the staging bytes must stay until put_quiet().
__device__ __forceinline__ void put_warp(const Common& c, int64_t off, int64_t n, int64_t staged_off, int pe) {
#ifdef EP_COMM_NVSHMEM
  if (n > 0) nvshmemx_putmem_nbi_warp(own_at(c, off), own_at(c, staged_off), static_cast<size_t>(n), pe);
#endif
}

// Completes this thread's puts (before the grid arrival that precedes the signals).
__device__ __forceinline__ void put_quiet() {
#ifdef EP_COMM_NVSHMEM
  nvshmem_quiet();
#endif
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

// ---- send items handed out as warps ask ---------------------------------------------------------
// Every warp takes one item of the first round (item = its global warp index); later items go to
// whichever warp asks first.  SMs do not drain their NVLink stores at one rate: with a fixed stride the
// blocks of a 4096-token dispatch finished sending up to 200 µs apart, the early ones then idle while
// the link still has room (docs/performance.md).  The queue word holds the call's code in its high 32
// bits and the next ticket in its low 32: block 0 opens it at the launch's start, a ticket counts only
// when its add returned the warp's own call's code, and the last block to arrive clears the word.
struct WorkQueue {
  unsigned long long* word;
  uint32_t code;
  int64_t first;  // items below this are the first round's (one per warp)
  int64_t end;
};

// Block 0, before its warps' first items: the queue of this call starts at ticket 0.  Only needed when
// there are more items than warps (no warp asks otherwise).
__device__ __forceinline__ void open_work(const WorkQueue& q) {
  if (q.end > q.first && blockIdx.x == 0 && threadIdx.x == 0)
    atomicExch(q.word, static_cast<unsigned long long>(q.code) << 32);
}

// The last block to arrive after the loop (every warp has left it): the word holds no code, so no later
// call can take this call's tickets, not even one whose code comes round again as call numbers wrap.
__device__ __forceinline__ void close_work(const WorkQueue& q) {
  if (q.end > q.first && threadIdx.x == 0) atomicExch(q.word, 0ull);
}

// The warp's next item after one it finished (q.end when none is left); every lane gets the same.
__device__ __forceinline__ int64_t next_work(const WorkQueue& q, int lane, uint64_t deadline_ns, const ErrorSink& err) {
  if (q.end <= q.first) return q.end;
  int64_t item = q.end;
  if (lane == 0) {
    // one atomic per item once the queue is open; an add that finds another call's code went to a word
    // block 0's opening overwrites, so it takes nothing: wait for the opening and ask again
    unsigned long long old = atomicAdd(q.word, 1ull);
    uint32_t spins = 0;
    bool open = true;
    while (static_cast<uint32_t>(old >> 32) != q.code) {
      if ((++spins & 255u) == 0 && global_timer_ns() > deadline_ns) {  // block 0 never ran: not all resident
        err.count(kStatusLocalStall, 1);
        open = false;
        break;
      }
      if (static_cast<uint32_t>(ld_acquire_gpu(q.word) >> 32) == q.code) old = atomicAdd(q.word, 1ull);
    }
    if (open) item = min(q.end, q.first + static_cast<int64_t>(old & 0xffffffffull));
  }
  return __shfl_sync(kFull, item, 0);
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

// Write ``value`` into this rank's slot of flag row ``row`` (see flag_slot) on every peer and this
// rank: for call flags, that this launch's sends are complete (called by the last block to arrive).
// Each thread releases its own flag so the NVLink round trips overlap.  ``threads`` > 0: only the
// block's first ``threads`` threads take part.
__device__ __forceinline__ void signal_all(const Common& c, int row, uint64_t value, int threads = 0) {
  const int stride = threads > 0 ? threads : static_cast<int>(blockDim.x);
  if (static_cast<int>(threadIdx.x) >= stride) return;
  for (int peer = threadIdx.x; peer < c.lay.world; peer += stride) {
    if (!peer_active(c.lay, peer)) continue;
#ifdef EP_COMM_NVSHMEM
    if (put_mode(c.lay) && peer != c.lay.rank) {  // ordered after this rank's quieted puts
      nvshmemx_signal_op(flag_slot(c, c.lay.rank, row, c.lay.rank), value, NVSHMEM_SIGNAL_SET, peer);
      continue;
    }
#endif
    st_release_sys(flag_slot(c, peer, row, c.lay.rank), value);
  }
}

}  // namespace
}  // namespace EP_KERNELS
}  // namespace ep_comm
