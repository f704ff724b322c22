// One-sided combine: one launch per call (send partials, signal, wait, sum), or two with a receive hook;
// prefill sizes of the standard layout run grouped (per-group flags, sums while the sends run: on warps
// of their own, or in turn with the sends).
#include "one_sided/combine_rows.cuh"

namespace ep_comm {
namespace EP_KERNELS {
namespace {

__device__ __forceinline__ uint64_t* group_flag(const Common& c, int owner, int parity, int src, int g) {
  return reinterpret_cast<uint64_t*>(peer_ptr(c, owner) + c.lay.group_flags_offset) +
         (static_cast<int64_t>(parity) * c.lay.world + src) * c.lay.max_groups + g;
}

// Wait for a peer's group flag; every few hundred polls also look at its call flag, where an abort or
// a later call shows up (group flags only ever carry combine codes).  Returns false after recording why.
__device__ __forceinline__ bool wait_group_flag(const Common& c, int parity, int src, int g, uint32_t code,
                                                uint64_t deadline, const ErrorSink& err) {
  const uint64_t* gf = group_flag(c, c.lay.rank, parity, src, g);
  const uint64_t* main = flag_slot(c, c.lay.rank, parity, src);
  uint32_t spins = 0;
  while (static_cast<uint32_t>(ld_acquire_sys(gf)) != code) {
    if ((++spins & 255u) != 0) continue;
    if (on_other_call(static_cast<uint32_t>(ld_acquire_sys(main)), code, src, err)) return false;
    if (global_timer_ns() > deadline) {
      err.peer(src, kReasonTimeout, static_cast<uint32_t>(ld_acquire_sys(gf)), code);
      err.count(kStatusTimeouts, 1);
      return false;
    }
  }
  return true;
}

// Grouped combine (prefill sizes): each block alternates between sending the partials of one group
// of kGroupTokens rows to their owner (then flagging that group) and summing one group of its own
// tokens whose partials have all been flagged, so the sums run while the link is still busy instead
// of after every block's sends.  Units are handed out in order (the send queue), and a block sums own
// group g about one round of units after g's last unit went out, about when the peers' matching groups
// arrive.  Split (p.grouped >= 2):
// blocks [0, p.grouped - 1) only send and the others only sum, each waiting for its groups' flags.
// With a receive hook the send half's blocks all send and the receive half's all sum: the same
// protocol, so ranks may hook or not independently.
template <typename Tin, typename Tout, bool kPrefetch>
__device__ __forceinline__ WorkQueue combine_grouped(const CombineParams& p, const Tin* eo, uint32_t code, int parity,
                                                     uint64_t deadline, const ErrorSink& err, const Tin** src_rows,
                                                     float* w, const Tout** parts, int lane, int warp) {
  const Layout& L = p.c.lay;
  const int peers = L.world - 1;
  const int groups = L.max_groups;
  const int send_units = peers * groups;
  const int own_groups = (p.num_tokens + kGroupTokens - 1) / kGroupTokens;
  const uint8_t* region = peer_ptr(p.c, L.rank) + L.combine_offset[parity];
  __shared__ int s_ok;
  // split (p.grouped >= 2): the first blocks only send, the others only sum, so the system fence
  // before each group's flag stalls senders only and the sums run at the pace the partials land; a
  // hooked call's send half is all senders, its receive half all summers
  const int grid = static_cast<int>(gridDim.x);
  const bool sends = p.phases & kPhaseSend, receives = p.phases & kPhaseReceive;
  const int senders = !receives ? grid : !sends ? 0 : p.grouped >= 2 ? min(grid - 1, p.grouped - 1) : 0;
  const bool split = senders > 0 || !sends;
  const bool summer = split && static_cast<int>(blockIdx.x) >= senders;
  const int sum_stride = split ? static_cast<int>(gridDim.x) - senders : static_cast<int>(gridDim.x);
  int next_sum = split ? static_cast<int>(blockIdx.x) - senders : static_cast<int>(blockIdx.x);
  auto sum_group = [&](int g) {
    if (threadIdx.x == 0) {
      bool ok = true;
      for (int i = 1; i < L.world; ++i) {
        const int src = (L.rank + i) % L.world;
        if (peer_active(L, src)) ok = wait_group_flag(p.c, parity, src, g, code, deadline, err) && ok;
      }
      s_ok = ok;
    }
    __syncthreads();
    const int t0 = g * kGroupTokens;
    const int rows = min(kGroupTokens, p.num_tokens - t0);
    // after a failed wait the call's result is void (the error record says why): skip the reads
    for (int item = warp; s_ok && item < rows * p.chunks; item += kWarps)
      sum_output_piece<Tin, Tout, kPrefetch>(p, eo, region, t0 + item / p.chunks, item % p.chunks, src_rows, w,
                                             parts, lane);
    __syncthreads();
  };
  // send units: the first round one per sending block, later ones as blocks ask (the send queue, as in
  // the push form: blocks drain their NVLink stores at different rates), so units go out in order.
  // Own group g is due once the unit just sent is about one round of units past g's last one,
  // (g + 1) x peers + grid.  Deadlock freedom: a block waits only holding no unit it has not sent, and
  // a waiting block's rank has handed out every unit of the group awaited; so the lowest group any rank
  // awaits has had its units to that rank handed out by every peer, to blocks that send them before
  // they wait.  When no sum is due the next unit is drawn by the last warp (not warp 0, whose thread 0
  // fences and flags while the block goes on), before this unit's sends or, near the end of the queue,
  // after its share; when sums are due it is drawn after them.
  const WorkQueue work{p.c.counters + kStateCombineWork, code, split ? senders : grid, send_units};
  if (sends) open_work(work);
  __shared__ int s_unit[2];  // by iteration parity: the draw ahead of a unit writes while others read
  for (int u = blockIdx.x, it = 0; !summer && u < send_units; ++it) {
    const auto due = [&] { return !split && next_sum < own_groups && (next_sum + 1) * peers + grid <= u; };
    const auto draw = [&] {  // by one warp: the block's next unit, for every thread after a barrier
      const int64_t next = next_work(work, lane, deadline, err);
      if (lane == 0) s_unit[it & 1] = static_cast<int>(next);
    };
    const bool sums = due();
    // drawn before this unit's sends away from the end of the queue; near it, once the warp's share is
    // sent, so that a block that drains slowly does not hold a unit a faster one could have taken
    const bool ahead = !sums && u + 2 * static_cast<int>(work.first) < send_units;
    if (ahead && warp == kWarps - 1) draw();
    const int src = (L.rank + 1 + u % peers) % L.world;
    const int t0 = (u / peers) * kGroupTokens;
    // a rank that left sent no rows: nothing to return to it
    const int rows = peer_active(L, src) ? min(kGroupTokens, L.max_tokens - t0) : 0;
    for (int item = warp; item < rows * p.chunks; item += kWarps)
      send_partial_piece<Tin, Tout, kPrefetch>(p, eo, src, t0 + item / p.chunks, item % p.chunks, parity, src_rows,
                                               w, lane);
    if (!sums && !ahead && warp == kWarps - 1) draw();
    __syncthreads();
    if (threadIdx.x == 0 && rows > 0) {
      __threadfence_system();  // the block's partials land before the group's flag
      st_release_sys(group_flag(p.c, src, parity, L.rank, u / peers), code);
    }
    if (sums) {
      while (due()) {
        sum_group(next_sum);
        next_sum += gridDim.x;
      }
      if (warp == 0) draw();
      __syncthreads();
    }
    u = s_unit[it & 1];
  }
  if (split && !summer) return work;
  for (; next_sum < own_groups; next_sum += sum_stride) sum_group(next_sum);
  return work;
}

// Grouped combine by warps (p.sum_warps > 0, both phases): the block's first warps only send units
// from the queue, in order, and flag each group; its last p.sum_warps warps only sum own groups, each
// once every peer has flagged it.  Sends never wait for sums, so the link is fed while the sums run.
// The send warps meet at named barrier 2, the summing warps at 3 (grid_arrive takes 1).  Deadlock
// freedom: summing warps wait only for peers' send warps, which wait for nothing but the queue.
template <typename Tin, typename Tout, bool kPrefetch>
__device__ __forceinline__ WorkQueue grouped_sends_by_warps(const CombineParams& p, const Tin* eo, uint32_t code,
                                                            int parity, uint64_t deadline, const ErrorSink& err,
                                                            const Tin** src_rows, float* w, int lane, int warp) {
  const Layout& L = p.c.lay;
  const int peers = L.world - 1;
  const int send_units = peers * L.max_groups;
  const int send_warps = kWarps - p.sum_warps;
  const auto sync_senders = [send_warps] { asm volatile("bar.sync 2, %0;" ::"r"(send_warps * kWarpSize) : "memory"); };
  const WorkQueue work{p.c.counters + kStateCombineWork, code, static_cast<int64_t>(gridDim.x), send_units};
  open_work(work);
  __shared__ int s_unit[2];  // by iteration parity: the draw ahead of a unit writes while others read
  for (int u = blockIdx.x, it = 0; u < send_units; ++it) {
    // the next unit is drawn by the last send warp before this unit's sends, away from the end of the
    // queue; near it, once the warp's share is sent (a block that drains slowly holds no unit a faster
    // one could have taken)
    const bool ahead = u + 2 * static_cast<int>(work.first) < send_units;
    const auto draw = [&] {
      const int64_t next = next_work(work, lane, deadline, err);
      if (lane == 0) s_unit[it & 1] = static_cast<int>(next);
    };
    if (ahead && warp == send_warps - 1) draw();
    const int src = (L.rank + 1 + u % peers) % L.world;
    const int t0 = (u / peers) * kGroupTokens;
    const int rows = peer_active(L, src) ? min(kGroupTokens, L.max_tokens - t0) : 0;
    for (int item = warp; item < rows * p.chunks; item += send_warps)
      send_partial_piece<Tin, Tout, kPrefetch>(p, eo, src, t0 + item / p.chunks, item % p.chunks, parity, src_rows,
                                               w, lane);
    if (!ahead && warp == send_warps - 1) draw();
    sync_senders();
    if (threadIdx.x == 0 && rows > 0) {
      __threadfence_system();  // the block's partials land before the group's flag
      st_release_sys(group_flag(p.c, src, parity, L.rank, u / peers), code);
    }
    u = s_unit[it & 1];
  }
  return work;
}

// The summing warps of grouped_sends_by_warps' blocks: own group g in block g mod grid, its rows shared
// by the block's p.sum_warps warps.
template <typename Tin, typename Tout, bool kPrefetch>
__device__ __forceinline__ void grouped_sums_by_warps(const CombineParams& p, const Tin* eo, uint32_t code, int parity,
                                                      uint64_t deadline, const ErrorSink& err, const Tin** src_rows,
                                                      float* w, const Tout** parts, int lane, int warp) {
  const Layout& L = p.c.lay;
  const int send_warps = kWarps - p.sum_warps;
  const int sum_warp = warp - send_warps;
  const int first_thread = send_warps * kWarpSize;
  const auto sync_summers = [&p] { asm volatile("bar.sync 3, %0;" ::"r"(p.sum_warps * kWarpSize) : "memory"); };
  const int own_groups = (p.num_tokens + kGroupTokens - 1) / kGroupTokens;
  const uint8_t* region = peer_ptr(p.c, L.rank) + L.combine_offset[parity];
  __shared__ int s_sum_ok;
  for (int g = blockIdx.x; g < own_groups; g += gridDim.x) {
    if (static_cast<int>(threadIdx.x) == first_thread) {
      bool ok = true;
      for (int i = 1; i < L.world; ++i) {
        const int src = (L.rank + i) % L.world;
        if (peer_active(L, src)) ok = wait_group_flag(p.c, parity, src, g, code, deadline, err) && ok;
      }
      s_sum_ok = ok;
    }
    sync_summers();
    const int t0 = g * kGroupTokens;
    const int rows = min(kGroupTokens, p.num_tokens - t0);
    // after a failed wait the call's result is void (the error record says why): skip the reads
    for (int item = sum_warp; s_sum_ok && item < rows * p.chunks; item += p.sum_warps)
      sum_output_piece<Tin, Tout, kPrefetch>(p, eo, region, t0 + item / p.chunks, item % p.chunks, src_rows, w,
                                             parts, lane);
    sync_summers();  // every warp has read s_sum_ok before the next group's wait writes it
  }
}

// The last block of a combine's send half to arrive: no later call may take this call's queue tickets,
// the peers get the call's flag, and the next call number is published (every block has arrived, so
// every block has read this one's).  ``threads`` > 0: only the block's first ``threads`` threads are here.
__device__ __forceinline__ void close_combine_sends(const CombineParams& p, const WorkQueue& work, uint64_t seq,
                                                    uint32_t code, int parity, int threads = 0) {
  close_work(work);
  signal_all(p.c, parity, code, threads);
  stamp(p.c.lay, kTraceCombine, kTrSignalled);
  if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;
}

// Pull combine (zero copy, standard layout, peers reached by stores): every rank's expert rows stay in
// its combine half 0, where the host had the experts write them.  The call flag says "my rows are
// readable" and goes out first; each rank then sums its tokens reading the owners' rows over NVLink
// (one pass: no partials written to a peer and read back), and a second flag per call ("done
// reading": group flag 0, unused without grouped sends) keeps every rank in the kernel until its
// peers have read its rows, so that its next expert outputs cannot overwrite them under a reader.
template <typename Tin, typename Tout, bool kPrefetch>
__device__ __forceinline__ void combine_pull(const CombineParams& p, const Tin* eo, uint64_t seq, uint32_t code,
                                             int parity, uint64_t deadline, const ErrorSink& err, const Tin** src_rows,
                                             float* w, const Tout** parts, int lane, int gwarp, int nwarps) {
  const Layout& L = p.c.lay;
  if ((p.phases & kPhaseSend) && blockIdx.x == 0) {
    __threadfence_system();  // the rows earlier kernels wrote, before the flag that lets peers read them
    signal_all(p.c, parity, code);
    stamp(L, kTraceCombine, kTrSignalled);
  }
  if (!(p.phases & kPhaseReceive)) {  // send half of a hooked call: only the flag
    const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/false, deadline, err);
    if (a.last && threadIdx.x == 0)  // every block has read seq
      *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;
    return;
  }
  __shared__ int s_readable;
  if (threadIdx.x == 0) {
    bool ok = true;
    for (int i = 1; i < L.world; ++i) {
      const int src = (L.rank + i) % L.world;
      if (!peer_active(L, src)) continue;
      ok = wait_flag(flag_slot(p.c, L.rank, parity, src), code, src, deadline, err) != 0 && ok;
    }
    s_readable = ok;
  }
  __syncthreads();
  stamp(L, kTraceCombine, kTrSource0);
  // after a failed wait the call's result is void (the error record says why): skip the reads
  for (int64_t item = gwarp; s_readable && item < static_cast<int64_t>(p.num_tokens) * p.chunks; item += nwarps)
    sum_output_piece<Tin, Tout, kPrefetch>(p, eo, nullptr, static_cast<int>(item / p.chunks),
                                           static_cast<int>(item % p.chunks), src_rows, w, parts, lane);
  stamp(L, kTraceCombine, kTrSent, true);
  // every block's reads are summed and stored before it arrives, so the last one may release the peers
  const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/false, deadline, err);
  if (!a.last) return;
  for (int peer = threadIdx.x; peer < L.world; peer += blockDim.x)
    if (peer != L.rank && peer_active(L, peer)) st_release_sys(group_flag(p.c, peer, parity, L.rank, 0), code);
  if (p.phases == kPhaseBoth && threadIdx.x == 0)
    *reinterpret_cast<volatile unsigned long long*>(p.c.counters + kStateSeq) = seq + 1;
  // wait for the "done" of every peer that released this call's "readable" flag by now, i.e. that may
  // read this rank's rows; one that never did was recorded by this launch's "readable" wait and is
  // not reading.  (One whose flag came after that wait gave up finds the deadline passed: it is
  // recorded again and not waited for.)  Decided per launch: the error record persists across
  // graph replays.
  for (int src = threadIdx.x; src < L.world; src += blockDim.x)
    if (src != L.rank && static_cast<uint32_t>(ld_acquire_sys(flag_slot(p.c, L.rank, parity, src))) == code)
      wait_group_flag(p.c, parity, src, 0, code, deadline, err);
  stamp(L, kTraceCombine, kTrArrived, true);
}

template <typename Tin, typename Tout, bool kPrefetch>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const CombineParams p) {
  const Layout& L = p.c.lay;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int gwarp = blockIdx.x * kWarps + warp;
  const int nwarps = gridDim.x * kWarps;
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  const ErrorSink err{p.c.status, L.pending, L.world};
  const auto [seq, code, parity] = current_call(p.c, kOpCombine, p.phases);
  stamp(L, kTraceCombine, kTrStart);

  __shared__ const Tin* s_src[kWarps][kMaxTopK];
  __shared__ float s_w[kWarps][kMaxTopK];
  __shared__ const Tout* s_part[kWarps][kMaxTopK];
  const Tin* eo = static_cast<const Tin*>(p.expert_out);

  if (p.pull) {
    combine_pull<Tin, Tout, kPrefetch>(p, eo, seq, code, parity, deadline, err, s_src[warp], s_w[warp], s_part[warp],
                                       lane, gwarp, nwarps);
    stamp(L, kTraceCombine, kTrEnd);
    return;
  }
  if (p.phases & kPhaseSend) {
    // ---- send: one partial per (token, owner rank) to [this rank][t] of each peer owner's combine region;
    // the partials of this rank's own tokens are summed straight from expert_out when receiving
    const int64_t peer_items = static_cast<int64_t>(L.world - 1) * L.max_tokens * p.chunks;
    const WorkQueue work{p.c.counters + kStateCombineWork, code, nwarps, peer_items};
    open_work(work);
    for (int64_t item = gwarp; item < peer_items; item = next_work(work, lane, deadline, err)) {
      const int64_t q = item / p.chunks;
      const int src = (L.rank + 1 + static_cast<int>(q / L.max_tokens)) % L.world;
      send_partial_piece<Tin, Tout, kPrefetch>(p, eo, src, static_cast<int>(q % L.max_tokens),
                                               static_cast<int>(item % p.chunks), parity, s_src[warp], s_w[warp],
                                               lane);
    }
    if (put_mode(L)) put_quiet();

    stamp(L, kTraceCombine, kTrSent, true);
    const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/false, deadline, err);
    stamp(L, kTraceCombine, kTrArrived);
    if (a.last) close_combine_sends(p, work, seq, code, parity);
    if (!(p.phases & kPhaseReceive)) return;
  }

  // ---- receive: wait for every peer's partials, then per own token sum them with this rank's own
  // expert rows in float32
  uint8_t* const own = peer_ptr(p.c, L.rank);
  if (threadIdx.x == 0) {
    for (int i = 1; i < L.world; ++i) {
      const int src = (L.rank + i) % L.world;
      const uint64_t* flag = reinterpret_cast<const uint64_t*>(own + L.flags_offset) + parity * L.world + src;
      if (peer_active(L, src)) wait_flag(flag, code, src, deadline, err);
    }
  }
  __syncthreads();
  stamp(L, kTraceCombine, kTrSource0);
  const uint8_t* region = own + L.combine_offset[parity];
  for (int64_t item = gwarp; item < static_cast<int64_t>(p.num_tokens) * p.chunks; item += nwarps)
    sum_output_piece<Tin, Tout, kPrefetch>(p, eo, region, static_cast<int>(item / p.chunks),
                                           static_cast<int>(item % p.chunks), s_src[warp], s_w[warp], s_part[warp],
                                           lane);
  stamp(L, kTraceCombine, kTrEnd, true);
}

// The grouped combine in a kernel of its own (launch_combine picks it): inlined into combine_kernel,
// its code changes how the compiler schedules the push form's sums, which then run about a third
// slower (docs/performance.md).
template <typename Tin, typename Tout, bool kPrefetch>
__global__ void __launch_bounds__(kThreads, 1) combine_grouped_kernel(const CombineParams p) {
  const Layout& L = p.c.lay;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  const ErrorSink err{p.c.status, L.pending, L.world};
  const auto [seq, code, parity] = current_call(p.c, kOpCombine, p.phases);
  stamp(L, kTraceCombine, kTrStart);

  __shared__ const Tin* s_src[kWarps][kMaxTopK];
  __shared__ float s_w[kWarps][kMaxTopK];
  __shared__ const Tout* s_part[kWarps][kMaxTopK];
  const Tin* eo = static_cast<const Tin*>(p.expert_out);
  const WorkQueue work = combine_grouped<Tin, Tout, kPrefetch>(p, eo, code, parity, deadline, err, s_src[warp],
                                                              s_w[warp], s_part[warp], lane, warp);
  stamp(L, kTraceCombine, kTrSent, true);
  if (p.phases & kPhaseSend) {
    // the call flag still goes out (peers on another call see it), but nothing here waits for it
    const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/false, deadline, err);
    if (a.last) close_combine_sends(p, work, seq, code, parity);
  }
  // a rank without tokens waited for no group above: it still ends only once every peer has sent
  // this combine (so after each peer's previous dispatch), as the ungrouped combine does; else its
  // next call's flags could overwrite a slot a slow peer has not read yet
  if (p.num_tokens == 0 && blockIdx.x == 0 && (p.phases & kPhaseReceive))
    for (int i = threadIdx.x; i < L.world; i += blockDim.x)
      if (i != L.rank && peer_active(L, i)) wait_flag(flag_slot(p.c, L.rank, parity, i), code, i, deadline, err);
  stamp(L, kTraceCombine, kTrEnd, true);
}

// The grouped combine by warps (p.sum_warps > 0) in a kernel of its own, so that the interleaved
// form's code and registers stay as they are: its prologue and tokenless tail repeat that kernel's, and
// grouped_sends_by_warps / grouped_sums_by_warps repeat combine_grouped's unit and group steps, because
// sharing them as functions moved that kernel's registers (119 -> 124 in the bf16 build) and it still
// serves hooked calls and EP_COMM_COMBINE_SUM_WARPS=0.
template <typename Tin, typename Tout, bool kPrefetch>
__global__ void __launch_bounds__(kThreads, 1) combine_grouped_warps_kernel(const CombineParams p) {
  const Layout& L = p.c.lay;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  const ErrorSink err{p.c.status, L.pending, L.world};
  const auto [seq, code, parity] = current_call(p.c, kOpCombine, p.phases);
  stamp(L, kTraceCombine, kTrStart);

  __shared__ const Tin* s_src[kWarps][kMaxTopK];
  __shared__ float s_w[kWarps][kMaxTopK];
  __shared__ const Tout* s_part[kWarps][kMaxTopK];
  const Tin* eo = static_cast<const Tin*>(p.expert_out);
  __syncthreads();  // every warp has read the call number before its block can arrive and publish the next
  const int send_threads = (kWarps - p.sum_warps) * kWarpSize;
  if (static_cast<int>(threadIdx.x) < send_threads) {
    const WorkQueue work = grouped_sends_by_warps<Tin, Tout, kPrefetch>(p, eo, code, parity, deadline, err,
                                                                        s_src[warp], s_w[warp], lane, warp);
    stamp(L, kTraceCombine, kTrSent);
    const Arrival a = grid_arrive(p.c.counters + kStateArrive, /*wait=*/false, deadline, err, send_threads);
    if (a.last) close_combine_sends(p, work, seq, code, parity, send_threads);
  } else {
    grouped_sums_by_warps<Tin, Tout, kPrefetch>(p, eo, code, parity, deadline, err, s_src[warp], s_w[warp],
                                                s_part[warp], lane, warp);
  }
  // a rank without tokens waited for no group: it still ends only once every peer has sent this combine
  // (combine_grouped_kernel says why)
  if (p.num_tokens == 0 && blockIdx.x == 0)
    for (int i = threadIdx.x; i < L.world; i += blockDim.x)
      if (i != L.rank && peer_active(L, i)) wait_flag(flag_slot(p.c, L.rank, parity, i), code, i, deadline, err);
  stamp(L, kTraceCombine, kTrEnd, true);
}

// Whether a combine takes the grouped protocol: prefill-sized, with peers, pushed by stores (a pulling
// combine reads in place; put mode signals once per call).
bool combine_is_grouped(const CombineParams& p) {
  return !p.pull && p.grouped && p.c.lay.world > 1 && !put_mode(p.c.lay);
}

// Whether the sums prefetch the next column block: only where a warp's loop is long, i.e. its pieces
// span more than one iteration and it sums at least two of them.  Prefill-sized combines gain (the
// batched one 5-10 %); where a warp sums about one piece (decode at EP4) the prefetches only cost, about
// 2 us (docs/performance.md).
template <typename Tin, typename Tout>
bool combine_prefetches(const CombineParams& p, int num_blocks) {
  return p.chunk_elems > 8 * kWarpSize * sum_cols<Tin, Tout>() &&
         static_cast<int64_t>(p.num_tokens) * p.chunks >= 2LL * num_blocks * kWarps;
}

}  // namespace

cudaError_t launch_combine(const CombineParams& p, int in_dtype, int out_dtype, int num_blocks,
                           cudaStream_t stream) {
  const dim3 grid(num_blocks), block(kThreads);
  const bool grouped = combine_is_grouped(p);
#define EP_COMBINE_WITH(Tin, Tout, P)                                                           \
  do {                                                                                          \
    if (grouped && p.sum_warps > 0) combine_grouped_warps_kernel<Tin, Tout, P><<<grid, block, 0, stream>>>(p); \
    else if (grouped) combine_grouped_kernel<Tin, Tout, P><<<grid, block, 0, stream>>>(p);      \
    else combine_kernel<Tin, Tout, P><<<grid, block, 0, stream>>>(p);                           \
  } while (0)
#define EP_COMBINE_AS(Tin, Tout)                                                                \
  do {                                                                                          \
    if (combine_prefetches<Tin, Tout>(p, num_blocks)) EP_COMBINE_WITH(Tin, Tout, true);         \
    else EP_COMBINE_WITH(Tin, Tout, false);                                                     \
  } while (0)
#define EP_COMBINE_OUT(Tin)                                                                     \
  do {                                                                                          \
    switch (out_dtype) {                                                                        \
      case kBf16: EP_COMBINE_AS(Tin, __nv_bfloat16); break;                                     \
      case kFp16: EP_COMBINE_AS(Tin, __half); break;                                            \
      default: EP_COMBINE_AS(Tin, float); break;                                                \
    }                                                                                           \
  } while (0)
  switch (in_dtype) {
    case kBf16: EP_COMBINE_OUT(__nv_bfloat16); break;
    case kFp16: EP_COMBINE_OUT(__half); break;
    default: EP_COMBINE_OUT(float); break;
  }
#undef EP_COMBINE_OUT
#undef EP_COMBINE_AS
#undef EP_COMBINE_WITH
  return cudaGetLastError();
}

}  // namespace EP_KERNELS
}  // namespace ep_comm
