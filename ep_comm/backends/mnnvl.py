"""``mnnvl``: one-sided NVLink dispatch/combine over a ``SymmetricBuffer`` (cuMem VMM, POSIX fds inside
a host, FABRIC handles across hosts of an NVL72 rack).

A dispatch is one kernel: route each token (duplicates merged, invalid ids dropped, in the kernel),
store one copy per destination rank straight into that rank's buffer (fp8 quantisation fused into
the store), signal, wait for every peer's signal, and lay the received rows out in the configured
layout.  A combine is one kernel the other way round: one partial per (token, owner rank), summed in
float32 by the owner.  Flags carry the call number, which advances on the device so CUDA-graph
replays stay in step; waits are bounded by ``timeout_s`` and end in an error record the host turns
into ``EPTimeoutError`` / ``EPError`` on the next call or ``check_errors()``.  No kernel traps.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

import torch

from ..errors import EPError, EPInputError, EPTimeoutError
from ..layouts import Dispatched
from ..memory import _driver
from ..memory.probe import IMEX_CHANNEL_DIR, probe_capabilities
from ..memory.symmetric import SymmetricBuffer
from . import kernel_ops
from . import kernel_protocol as kp
from .base import Availability, BackendContext

NUM_SMS_ENV = "EP_COMM_NUM_SMS"
ID_POLL_S = 2e-3  # how long the host polls for the eager id check before it blocks
TRACE_ENV = "EP_COMM_TRACE"  # "1": the kernels stamp their phases (a diagnostic; costs block barriers)


def _spins_for_the_host(device_index: int) -> bool:
    """Whether the host may busy-wait for the id check: not where the process asked CUDA to yield or
    block while waiting (then it waits the way it asked), nor where the driver cannot say."""
    try:
        return not _driver.host_waits_yield(device_index)
    except Exception:  # noqa: BLE001 - the synchronising wait is always right, only slower
        return False


@dataclasses.dataclass
class KernelHandle:
    """What combine needs from a dispatch: per received row its local ids, weights and (batched)
    flat slots, and per own token its destination ranks."""

    row_ids: torch.Tensor
    row_w: torch.Tensor
    row_slot: torch.Tensor
    dest: torch.Tensor
    outputs: tuple  # what the dispatch op returned but dest: the receive half of a split call fills them


class MnnvlBackend:
    name = "mnnvl"
    graph_capturable = True
    kernel = True  # routing guard, quantisation and validation of ids happen in the kernels
    recv_hooks = True  # dispatch_split / combine_split: send now, receive when the hook runs
    ops_prefix = "mnnvl"  # torch.ops.ep_comm.<prefix>_dispatch etc.

    def __init__(self, ctx: BackendContext, buffer: SymmetricBuffer, layout: kp.BufferLayout, num_blocks: int):
        self.ctx = ctx
        self.buffer = buffer
        self.layout = layout
        self.num_sms = num_blocks
        dev = ctx.device
        self.state = torch.zeros(kp.state_numel(ctx.world_size), dtype=torch.int64, device=dev)
        self.work = torch.zeros(layout.work_numel(ctx.num_local_experts), dtype=torch.int32, device=dev)
        self._mapped = kernel_ops.MappedWords()
        self._flags = self._mapped.words
        self._ids_flag_ptr = self._mapped.device_ptr + 4 * kp.PENDING_IDS_CHECK
        L = ctx.num_local_experts
        owners = torch.arange(ctx.cfg.num_experts, dtype=torch.int32)
        self.expert_owner = ((owners // L) * 65536 + owners % L).to(torch.int32).to(dev)
        self.peer_base = buffer.peer_ptrs
        ops = torch.ops.ep_comm
        self._dispatch_op = getattr(ops, f"{self.ops_prefix}_dispatch")
        self._dispatch_recv_op = getattr(ops, f"{self.ops_prefix}_dispatch_recv")
        self._combine_kernel_op = getattr(ops, f"{self.ops_prefix}_combine")
        self._abort_op = getattr(ops, f"{self.ops_prefix}_abort")
        self.cfg_vec = kp.config_vector(ctx.cfg, ctx.rank, ctx.world_size, layout, num_blocks,
                                        self._mapped.device_ptr)
        self.zero_copy = bool(self.cfg_vec[kp.ZERO_COPY])
        self._zero_copy_views: dict = {}
        self._input_rows: Optional[torch.Tensor] = None  # dispatch_input_buffer's view, made once
        # zero copy: combine reads the peers' expert rows in place (one pass over NVLink, no partials
        # written and read back).  Every rank must run the same protocol: everything the layout's
        # answer depends on is a shared setting the communicator checked ($EP_COMM_COMBINE_PULL too)
        self._expert_rows: Optional[torch.Tensor] = None
        if layout.combine_pull:
            lay, n, cfg = layout, ctx.world_size * ctx.cfg.max_tokens_per_rank, ctx.cfg
            nbytes = n * cfg.hidden * cfg.dtype.itemsize
            self._expert_rows = buffer.local[lay.combine_offset[0]: lay.combine_offset[0] + nbytes] \
                .view(cfg.dtype).view(n, cfg.hidden)
            self.cfg_vec[kp.COMBINE_PULL_INPUT] = self._expert_rows.data_ptr()
        self._fatal: Optional[EPError] = None
        self._ids_checked = torch.cuda.Event()  # recorded after the last queued id check
        self._ids_check_queued = False
        self._ids_wait_spin = _spins_for_the_host(ctx.device.index)
        # phase stamps for bench/kernel_trace.py: [2 ops][num_blocks][TRACE_SLOTS] globaltimer ns
        self.trace: Optional[torch.Tensor] = None
        if os.environ.get(TRACE_ENV) == "1":
            self.trace = torch.zeros(2 * num_blocks * kp.TRACE_SLOTS, dtype=torch.int64, device=dev)
            self.cfg_vec[kp.TRACE_PTR] = self.trace.data_ptr()

    # -- protocol ---------------------------------------------------------------------------------------
    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        why = kernels_unavailable(ctx)
        if why:
            return Availability(False, why)
        caps = probe_capabilities(ctx.device.index)
        if not caps.cuda or not caps.vmm_supported:
            return Availability(False, f"cuMem VMM unusable on this GPU ({caps.reason or 'VMM not supported'})")
        topo = ctx.topology
        if topo.num_hosts > 1 and not caps.fabric_permitted:
            return Availability(False, (
                f"ranks span {topo.num_hosts} hosts and peers on other hosts can only be mapped with FABRIC "
                f"handles, which this rank cannot create: {caps.fabric_summary()}. FABRIC handles need an IMEX "
                f"channel ({IMEX_CHANNEL_DIR}/channelN present in the container) and, across nodes, the "
                f"nvidia-imex daemon"))
        if topo.local_world_size > 1 and not (caps.posix_fd_permitted or caps.fabric_permitted):
            return Availability(False, f"same-host peers need POSIX fd handles: cuMemCreate/export failed "
                                       f"({caps.posix_fd_error})")
        return Availability(True)

    @classmethod
    def create(cls, ctx: BackendContext) -> "MnnvlBackend":
        layout = kp.backend_layout(ctx.cfg, ctx.world_size)
        num_blocks = kp.default_num_blocks(ctx.cfg, ctx.device, os.environ.get(NUM_SMS_ENV))
        buf = SymmetricBuffer.create(layout.nbytes, ctx.control, ctx.topology, ctx.device.index,
                                     usable_backends=("ag_rs", "naive"), timeout_s=ctx.cfg.timeout_s)
        try:
            # flags and row headers start at zero (no call has code 0) before any peer may write
            buf.local.zero_()
            torch.cuda.synchronize(ctx.device)
            ctx.control.barrier()
            return cls(ctx, buf, layout, num_blocks)
        except BaseException:
            buf.close()
            raise

    def close(self) -> None:
        try:
            self.buffer.close()  # synchronises first, so no kernel still writes the mapped words
        finally:
            self._mapped.release()

    # -- data path ----------------------------------------------------------------------------------------
    def check_inputs(self, x: torch.Tensor, x_scales: Optional[torch.Tensor]) -> None:
        """Rows must fit the buffer's row layout (the generic checks already ran)."""
        if x_scales is not None:
            nbytes = x_scales.shape[1] * x_scales.element_size()
            if nbytes > self.layout.scale_max:
                raise EPInputError(f"x_scales rows hold {nbytes} bytes; backend {self.name} carries at most "
                                   f"{self.layout.scale_max} bytes of scales per token (hidden={self.ctx.cfg.hidden})")

    def start_id_check(self, topk_ids: torch.Tensor) -> None:
        """Queue the range check of every id (host-mapped answer) and an event after it.  The dispatch
        is launched behind it and the host waits on the event afterwards, so the GPU never idles
        while the host decides (the dispatch kernel abandons the call itself if an id is bad)."""
        self._flags[kp.PENDING_IDS_CHECK] = 0
        self._ids_check_queued = topk_ids.numel() > 0
        if self._ids_check_queued:
            torch.ops.ep_comm.check_ids(topk_ids, self.ctx.cfg.num_experts, self._ids_flag_ptr)
            self._ids_checked.record(torch.cuda.current_stream(self.ctx.device))

    def id_check_passed(self) -> bool:
        """One device→host synchronisation: with the check kernel, not with the dispatch behind it."""
        if self._ids_check_queued:
            done = False
            if self._ids_wait_spin:
                # polled, not cudaEventSynchronize: the host gets back to the stream sooner, which
                # is on the eager dispatch's critical path (A/B on nvidia-h200-x2 in bench/NOTES.md).
                # Bounded, as query() keeps the GIL: a host far ahead of its stream then blocks
                # (releasing it) rather than holding other Python threads off for milliseconds.
                give_up = time.perf_counter() + ID_POLL_S
                while not (done := self._ids_checked.query()) and time.perf_counter() < give_up:
                    pass
            if not done:
                self._ids_checked.synchronize()
        return not bool(self._flags[kp.PENDING_IDS_CHECK])

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor], epoch: int, abandon_on_invalid: bool = False) -> Dispatched:
        return self._dispatch(x, topk_ids, topk_weights, x_scales, epoch, _phases(kp.PHASE_BOTH, abandon_on_invalid))

    def dispatch_split(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       x_scales: Optional[torch.Tensor], epoch: int,
                       abandon_on_invalid: bool = False) -> tuple[Dispatched, Callable[[], None]]:
        """The send half now; the returned function launches the receive half, which fills the
        ``Dispatched`` tensors (on the stream current when it is called)."""
        d = self._dispatch(x, topk_ids, topk_weights, x_scales, epoch, _phases(kp.PHASE_SEND, abandon_on_invalid))
        raw = d.handle.outputs

        def receive() -> None:
            self._dispatch_recv_op(x, x_scales, self.state, self.work, self.peer_base, *raw,
                                                  self.cfg_vec)
        return d, receive

    def _dispatch(self, x, topk_ids, topk_weights, x_scales, epoch: int, phases: int) -> Dispatched:
        x = self._apart_from_buffer(x)
        out_x, out_s, row_ids, row_w, row_slot, counts, dest = self._dispatch_op(
            x, topk_ids, topk_weights, x_scales, self.state, self.work, self.peer_base, self.expert_owner, self.cfg_vec,
            phases)
        has_scales = self.ctx.cfg.quant == "fp8" or x_scales is not None
        handle = KernelHandle(row_ids, row_w, row_slot, dest, (out_x, out_s, row_ids, row_w, row_slot, counts))
        if self.zero_copy:  # the op returned no rows: they stay in the buffer (kCfgZeroCopy)
            out_x = self._rows_in_buffer(self.layout.meta_bytes, out_x)
            out_s = self._rows_in_buffer(self.layout.scale_offset, out_s) if has_scales else out_s
        scales = out_s if has_scales else None
        if self.ctx.cfg.layout == "batched":
            return Dispatched(layout="batched", x=out_x, x_scales=scales, expert_num_tokens=counts,
                              num_tokens=x.shape[0], epoch=epoch, handle=handle)
        return Dispatched(layout="standard", x=out_x, x_scales=scales, topk_ids=row_ids, topk_weights=row_w,
                          num_tokens=x.shape[0], epoch=epoch, handle=handle)

    def _rows_in_buffer(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """``[world * max_tokens, width]`` of ``like``'s dtype and width: the field at byte ``offset`` of
        every row of dispatch half 0, a row-strided view of this rank's buffer (made once per field)."""
        key = (offset, like.dtype, like.shape[-1])
        view = self._zero_copy_views.get(key)
        if view is None:
            lay, n = self.layout, self.ctx.world_size * self.ctx.cfg.max_tokens_per_rank
            start = lay.dispatch_offset[0]
            rows = self.buffer.local[start: start + n * lay.row_stride].view(n, lay.row_stride)
            nbytes = like.shape[-1] * like.element_size()
            view = self._zero_copy_views[key] = rows[:, offset: offset + nbytes].view(like.dtype)
        return view

    def dispatch_input_buffer(self) -> Optional[torch.Tensor]:
        """Zero copy without fp8 quantisation: this rank's own rows of dispatch half 0 as
        ``[max_tokens_per_rank, hidden]`` of ``cfg.dtype`` (row-strided).  A dispatch of its first T rows
        sends them from where they lie and moves no own rows (they are ``Dispatched.x``'s own rows
        already).  None otherwise."""
        cfg = self.ctx.cfg
        if not self.zero_copy or cfg.quant is not None:
            return None
        if self._input_rows is None:
            like = torch.empty(0, cfg.hidden, dtype=cfg.dtype)
            m = cfg.max_tokens_per_rank
            self._input_rows = self._rows_in_buffer(self.layout.meta_bytes, like)[self.ctx.rank * m: (self.ctx.rank + 1) * m]
        return self._input_rows

    def _apart_from_buffer(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` unless it overlaps this rank's buffer other than as the in-place input: the kernel
        writes the own rows while other warps still read x, so any other overlap goes as a copy.
        Without zero copy no view of the buffer is ever handed out (and the pointer arithmetic would
        not trace under torch.compile)."""
        if not self.zero_copy or x.numel() == 0:
            return x
        buf, n = self.buffer.local, x.shape[0]
        start = x.data_ptr()
        end = start + ((n - 1) * x.stride(0) + x.shape[1]) * x.element_size()
        if end <= buf.data_ptr() or start >= buf.data_ptr() + buf.numel():
            return x
        rows = self.dispatch_input_buffer()
        in_place = rows is not None and n <= rows.shape[0] and _same_view(x, rows[:n])
        return x if in_place else x.clone(memory_format=torch.contiguous_format)

    @property
    def combine_pulls(self) -> bool:
        """Whether combine reads the expert rows in place (zero copy, from PULL_MIN_TOKENS)."""
        return self._expert_rows is not None

    def expert_output_buffer(self, dispatched: Dispatched) -> Optional[torch.Tensor]:
        """Pulling combines: the ``[N, hidden]`` rows of this rank's buffer that combine reads (peers
        over NVLink); experts that write their outputs there save combine a copy.  None otherwise."""
        return self._expert_rows

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: torch.Tensor) -> torch.Tensor:
        target = _contiguous_target(out)
        self._combine_op(expert_out, dispatched, target, kp.PHASE_BOTH)
        if target is not out:
            out.copy_(target)
        return out

    def combine_split(self, expert_out: torch.Tensor, dispatched: Dispatched,
                      out: torch.Tensor) -> Callable[[], None]:
        """The send half of a combine now; the returned function launches the receive half, after
        which ``out`` holds the result."""
        target = _contiguous_target(out)
        self._combine_op(expert_out, dispatched, target, kp.PHASE_SEND)

        def receive() -> None:
            self._combine_op(expert_out, dispatched, target, kp.PHASE_RECEIVE)
            if target is not out:
                out.copy_(target)
        return receive

    def _combine_op(self, expert_out: torch.Tensor, dispatched: Dispatched, target: torch.Tensor, phases: int) -> None:
        h: KernelHandle = dispatched.handle
        rows = self._expert_rows
        if rows is not None:  # peers read the rows in place: the kernel is handed the buffer's rows
            if phases & kp.PHASE_SEND and not _same_view(expert_out, rows):
                rows.copy_(expert_out)  # (cast to the buffer's dtype)
            expert_out = rows
        self._combine_kernel_op(expert_out, h.row_ids, h.row_w, h.row_slot, h.dest, self.state,
                                        self.peer_base, target, self.cfg_vec, phases)

    def abort(self, reason: BaseException) -> None:
        """This rank's input was invalid: end every peer's current call now, with an error naming this
        rank.  The ranks' call sequences cannot be trusted afterwards, so the communicator is unusable."""
        if self._fatal is None:
            self._mark_abandoned(reason)
            self._abort_op(self.state, self.peer_base, self.cfg_vec)

    def abandoned_in_kernel(self, reason: BaseException) -> None:
        """The dispatch launched with ``abandon_on_invalid`` met this rank's invalid ids and signalled
        the peers an abort itself: from now on every call raises, as after ``abort``."""
        if self._fatal is None:
            self._mark_abandoned(reason)

    def _mark_abandoned(self, reason: BaseException) -> None:
        self._fatal = EPError(f"communicator unusable: rank {self.ctx.rank} abandoned a call after invalid "
                              f"input ({type(reason).__name__}: {reason}); create a new Communicator")

    # -- errors -------------------------------------------------------------------------------------------
    def poll_errors(self) -> None:
        """Before a call: raise a recorded peer problem (the call sequence is broken, so the call must
        not be launched).  Synchronises only when the device recorded one."""
        if self._fatal is not None:
            raise self._fatal
        if self._flags[kp.PENDING_FATAL]:
            self.check_errors()

    def recoverable_pending(self) -> bool:
        """Whether an earlier call dropped out-of-range ids (validation off), without synchronising."""
        return bool(self._flags[kp.PENDING_RECOVERABLE])

    def check_errors(self) -> None:
        """Synchronise, then raise (and clear) whatever the kernels recorded."""
        if self._fatal is not None:
            raise self._fatal
        torch.cuda.synchronize(self.ctx.device)
        words = self.state[kp.STATE_COUNTERS:].view(torch.int32)
        report = kp.StatusReport.from_words(words.tolist(), self.ctx.world_size)
        self._flags[kp.PENDING_FATAL] = self._flags[kp.PENDING_RECOVERABLE] = 0
        if report.empty:
            return
        words.zero_()
        raise self._error_from(report)

    def _last_signalled(self, rep: kp.StatusReport) -> list[int]:
        """Per rank, the latest call code it wrote into this rank's flags (either parity) or the one the
        kernel saw when it flagged the rank: the slot a wait read may hold a call from two calls ago, or
        nothing, when the peer stopped one call earlier."""
        world, off = self.ctx.world_size, self.layout.flags_offset
        slots = self.buffer.local[off: off + 2 * world * 8].view(torch.int64).view(2, world).tolist()
        # a format error records the peer's row width, not a code
        seen = [0 if rep.reasons[r] & kp.REASON_FORMAT else rep.seen[r] for r in range(world)]
        return [kp.latest_code(seen[r], slots[0][r], slots[1][r]) for r in range(world)]

    def _error_from(self, rep: kp.StatusReport) -> EPError:
        me, t = self.ctx.rank, self.ctx.cfg.timeout_s
        expected = kp.describe_code(rep.expected_code)
        last = self._last_signalled(rep)
        seen = lambda ranks: "; ".join(f"rank {r} last signalled {kp.describe_code(last[r])}" for r in ranks)  # noqa: E731
        if rep.local_stall:
            fatal: EPError = EPError(f"rank {me}: {self.name} kernel blocks were not all resident within timeout_s={t:g} "
                                     f"(num_sms={self.num_sms} too large while other kernels hold the GPU?)")
        elif rep.ranks_with(kp.REASON_ABORT):
            aborted = rep.ranks_with(kp.REASON_ABORT)
            fatal = EPInputError(f"invalid input on peer rank(s) {aborted}: they abandoned {expected} (their own "
                                 f"error says why); this rank's result of that call is incomplete")
        elif rep.ranks_with(kp.REASON_TIMEOUT):
            flagged = rep.ranks_with(kp.REASON_TIMEOUT)
            missing, waiting = _behind_and_in_step(flagged, last, rep.expected_code)
            also = (f"; rank(s) {waiting} reached {expected} too but had not finished it when this rank gave up "
                    "(they wait on the same missing rank(s))") if waiting else ""
            fatal = EPTimeoutError(
                f"rank {me}: {self.name} {expected} did not complete within timeout_s={t:g}: no signal from rank(s) "
                f"{missing} ({seen(missing)}){also}", missing_ranks=missing)
        elif rep.ranks_with(kp.REASON_MISMATCH):
            fatal = EPError(f"rank {me}: ranks are on different calls: this rank was in {expected}, "
                            f"{seen(rep.ranks_with(kp.REASON_MISMATCH))}; every rank must call dispatch/combine "
                            "in the same order")
        elif rep.ranks_with(kp.REASON_FORMAT):
            fatal = EPInputError(f"rank(s) {rep.ranks_with(kp.REASON_FORMAT)} sent rows of another payload/scale "
                                 f"width than rank {me} in the same call; every rank must pass x and x_scales "
                                 "of the same width and dtype")
        elif rep.overflow:
            fatal = EPError(f"rank {me}: a peer announced more than max_tokens_per_rank="
                            f"{self.ctx.cfg.max_tokens_per_rank} tokens")
        else:
            # ids were treated as -1 on every rank alike: the ranks are still in step
            return EPInputError(f"{rep.invalid_ids} topk_ids outside [-1, num_experts={self.ctx.cfg.num_experts}) "
                                f"were treated as -1 (id validation switched off, or a CUDA-graph replay)")
        # the ranks' call sequences can no longer be trusted: every later call raises this too
        self._fatal = fatal
        return fatal


def _behind_and_in_step(flagged: list[int], last: list[int], expected: int) -> tuple[list[int], list[int]]:
    """The ranks a wait gave up on, split into those that never reached the call and those that did.
    With three or more ranks one missing rank holds up the others too (a pulling combine releases its
    peers only after reading every rank's rows), so their late "done" flags get them recorded as well;
    naming them as missing would blame ranks that are in step.  When every flagged rank reached the
    call, they are all named: they are the ones stuck in it."""
    behind = [r for r in flagged if last[r] != expected]
    return (behind, [r for r in flagged if r not in behind]) if behind else (flagged, [])


def kernels_unavailable(ctx: BackendContext) -> str:
    """'' when the kernel backends' kernels can run this config on this rank's device, else why not."""
    if ctx.device.type != "cuda":
        return f"needs CUDA tensors (this communicator runs on {ctx.device.type})"
    why = kernel_ops.unavailable_reason()
    if why:
        return why
    if ctx.cfg.top_k > kp.MAX_TOP_K:
        return f"top_k={ctx.cfg.top_k} exceeds the kernels' limit of {kp.MAX_TOP_K}"
    if ctx.num_local_experts > kp.MAX_LOCAL_EXPERTS:
        return f"{ctx.num_local_experts} experts per rank exceed the kernels' limit of {kp.MAX_LOCAL_EXPERTS}"
    return ""


def _phases(halves: int, abandon_on_invalid: bool) -> int:
    return halves | (kp.PHASE_ABANDON_ON_INVALID if abandon_on_invalid else 0)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is exactly the tensor ``b`` views (address, dtype, shape, strides)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


def _contiguous_target(out: torch.Tensor) -> torch.Tensor:
    """``out`` itself, or a contiguous stand-in (the kernels write rows contiguously)."""
    return out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
