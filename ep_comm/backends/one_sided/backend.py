"""The one-sided family: dispatch/combine by stores (or puts) into the peers' buffers, over a memory
provider.  ``mnnvl`` maps the peers' buffers with cuMem VMM (``SymmetricBuffer``); ``nvshmem`` uses
NVSHMEM's symmetric heap.  Everything else is this file's.

A dispatch is one kernel: route each token (duplicates merged, invalid ids dropped, fp8 quantised, in
the kernel), store one copy per destination rank straight into that rank's buffer, signal, wait for
every peer's signal, and lay the received rows out in the configured layout.  A combine is one kernel
the other way round.  Flags carry the call number, which advances on the device so CUDA-graph replays
stay in step; waits are bounded by ``timeout_s`` and end in an error record, never a trap.

The host's part of a call, which makes no round trip to the peers:
  * before launching, a problem the device recorded in an earlier call is raised (synchronising only
    when the host-mapped word says there is one): the ranks are out of step, so nothing is launched;
  * eager dispatches with ``validate_ids`` queue an input verdict in front of the kernel: every
    rank's ids are range-checked and the verdicts exchanged on the device, the host waits for that
    small kernel only (after launching the dispatch), and when any rank's input was bad (ids out of
    range, or input its host refused) every rank's dispatch kernel skips the call and every rank
    raises in this call; the call numbers stay in step and the communicator stays usable;
  * input a rank cannot send without a verdict (validation off, or a combine's) is abandoned with an
    abort signal, so the peers raise instead of timing out (after their next combine's launch, or at
    ``check_errors()``): an abandoned dispatch gives up its own call number and that of the combine
    the peers are on their way to, an abandoned combine its own, so the ranks stay in step;
  * ids dropped with validation off are raised once the next combine has been launched, so the
    ranks stay in step.
"""
from __future__ import annotations

import dataclasses
import os
from typing import ClassVar, Optional, Protocol

import torch

from ...errors import EPConfigError, EPError, EPInputError, EPTimeoutError
from ...layouts import Dispatched
from ...routing import check_ids, count_inactive_pairs
from .. import extension
from ..base import (
    Availability,
    Backend,
    BackendContext,
    Capabilities,
    CombineCall,
    DispatchCall,
    ReceiveHalf,
    capturing_graph,
)
from ..protocol import Limit, Phase, describe_code
from .device import Kernels
from .errors import error_from, last_signalled
from .layout import NUM_SMS_ENV, BufferLayout, backend_layout, default_num_blocks
from .ops import KernelOps


class SymmetricMemory(Protocol):
    """What the family uses of a provider's buffer: this rank's bytes and every rank's base address."""

    @property
    def local(self) -> torch.Tensor:
        """uint8 ``[nbytes]`` on the device (read-only: an attribute or a property satisfies it)."""

    peer_ptrs: torch.Tensor  # int64 [world] on the device: each rank's buffer as this process reaches it


class MemoryProvider(Protocol):
    """How a one-sided backend gets its buffer and which build of the kernels reaches it."""

    ops_prefix: str  # torch.ops.ep_comm.<prefix>_dispatch etc.

    def unavailable(self, ctx: BackendContext) -> str:
        """'' when this rank can allocate and reach the peers' memory, else why not (local check)."""

    def put_mode(self, ctx: BackendContext) -> bool:
        """Whether peers are reached by puts from staging copies (collective: the same on every rank)."""

    def allocate(self, ctx: BackendContext, nbytes: int, put_mode: bool) -> SymmetricMemory:
        """Collective: every rank's buffer of ``nbytes``, reachable from every rank."""

    def release(self, ctx: BackendContext, memory: SymmetricMemory, collective: bool) -> None:
        """Free the buffer.  ``collective=False`` after a lost peer or a failed create: nothing may wait on
        the peers.  Otherwise a provider whose free is collective first meets the peers, bounded (after a
        timeout they may all be alive and closing, or not)."""


@dataclasses.dataclass
class KernelHandle:
    """What combine needs from a dispatch: per received row its local ids, weights and (batched) flat
    slots, and per own token its destination ranks; ``outputs``: what the dispatch op returned but
    ``dest``, which the receive half of a split call fills."""

    row_ids: torch.Tensor
    row_w: torch.Tensor
    row_slot: torch.Tensor
    dest: torch.Tensor
    outputs: tuple


class OneSidedBackend(Backend):
    """The family; a backend of it names its memory provider (``memory``)."""

    memory: ClassVar[MemoryProvider]

    def __init__(self, ctx: BackendContext, buffer: SymmetricMemory, layout: BufferLayout, kernels: Kernels):
        self.ctx, self.buffer, self.layout, self.kernels = ctx, buffer, layout, kernels
        cfg = ctx.cfg
        self.zero_copy = kernels.zero_copy
        self._fatal: Optional[EPError] = None  # raised by every call once the ranks are out of step
        self._handed_over = False  # shrink gave the buffer to the survivors' backend
        self._uncombined: Optional[int] = None  # zero copy: the dispatch whose rows are still in use
        self._views: dict = {}
        self._input_rows: Optional[torch.Tensor] = None
        # combine pulls: peers read this rank's expert rows in place (one pass over NVLink, no partials
        # written and read back).  Every rank runs the same protocol: what the layout's answer depends
        # on is a setting the communicator checked to be the same everywhere
        self._expert_rows: Optional[torch.Tensor] = None
        if layout.combine_pull:
            n = ctx.world_size * cfg.max_tokens_per_rank
            start = layout.combine_offset[0]
            self._expert_rows = buffer.local[start: start + n * cfg.hidden * cfg.dtype.itemsize] \
                .view(cfg.dtype).view(n, cfg.hidden)
            kernels.read_expert_rows_from(self._expert_rows)
        self._capabilities = Capabilities(recv_hooks=True, zero_copy=self.zero_copy,
                                          combine_in_place=self._expert_rows is not None,
                                          num_sms=kernels.num_blocks)

    # -- creation -------------------------------------------------------------------------------------
    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        why = quant_unsupported(ctx.cfg.quant) or kernels_unavailable(ctx) or cls.memory.unavailable(ctx)
        return Availability(not why, why)

    @classmethod
    def create(cls, ctx: BackendContext) -> OneSidedBackend:
        put = cls.memory.put_mode(ctx)
        layout = backend_layout(ctx.cfg, ctx.world_size, put_mode=put)
        num_blocks = default_num_blocks(ctx.cfg, ctx.device, os.environ.get(NUM_SMS_ENV))
        buf = cls.memory.allocate(ctx, layout.nbytes, put)
        try:
            # flags and row headers start at zero (no call has code 0) before any peer may write
            buf.local.zero_()
            torch.cuda.synchronize(ctx.device)
            ctx.control.barrier()
            kernels = Kernels(ctx, buf.local, buf.peer_ptrs, layout, num_blocks,
                              KernelOps.load(cls.memory.ops_prefix))
            return cls(ctx, buf, layout, kernels)
        except BaseException:
            cls.memory.release(ctx, buf, collective=False)
            raise

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def close(self) -> None:
        # after a timeout every peer may still be alive (one skipped a call) and closing too: the
        # provider meets them, bounded, before anything collective; a peer known to be gone (or left
        # behind by a shrink) is not met
        lost = not self.ctx.is_full or (isinstance(self._fatal, EPTimeoutError) and bool(self._fatal.lost_ranks))
        try:
            if not self._handed_over:
                self.memory.release(self.ctx, self.buffer, collective=not lost)
        finally:
            self.kernels.release()

    def shrink(self, ctx: BackendContext) -> OneSidedBackend:
        """The survivors' backend over the same buffer: ranks that left are neither signalled nor waited
        for, and their experts' owner entries are negative, so their pairs are dropped in the kernel.
        The survivors agree on a first call number above every call any of them made: whatever flags
        and rows the calls before the loss left in the buffers are then stale to every wait."""
        torch.cuda.synchronize(self.ctx.device)  # a call cut short by the loss has ended on the device
        first_call = max(ctx.control.gather_objects(self.kernels.calls_made())) + 2
        kernels = Kernels(ctx, self.buffer.local, self.buffer.peer_ptrs, self.layout, self.kernels.num_blocks,
                          self.kernels.ops, first_call=first_call)
        shrunk = type(self)(ctx, self.buffer, self.layout, kernels)
        self._handed_over = True
        return shrunk

    # -- dispatch -------------------------------------------------------------------------------------
    def dispatch(self, call: DispatchCall, recv_hook: bool) -> tuple[Dispatched, Optional[ReceiveHalf]]:
        compiling = torch.compiler.is_compiling()
        if compiling and self.zero_copy:
            # nothing in a traced graph orders the reads of the buffer's rows after the op that fills them
            raise EPConfigError("zero_copy", True, "its rows are views of the receive buffer, which a torch.compile "
                                "graph cannot order after the dispatch; use eager calls or CUDA graphs")
        host_checks = not compiling and not capturing_graph(self.ctx.device)
        if host_checks:
            # ids an earlier call dropped are raised by the next combine, after its launch: raised
            # here, after this dispatch went out, they would leave the caller without the rows its
            # peers combine next
            self._before_call()
        cfg = self.ctx.cfg
        # eager calls with id validation run an input verdict in front of the dispatch: every rank
        # learns in this call whether any rank's input was bad, and every rank's kernel skips it alike
        checked = host_checks and cfg.validate_ids
        error = call.error or self._unsendable(call)
        if error is not None:
            if checked:
                self.kernels.refuse()
            else:  # the peers learn it in their dispatch kernel, and raise it by a later call
                self._abandon(error, calls=2)
            raise error
        if checked:  # answered after the launch: the GPU never waits for the host to decide
            self.kernels.start_verdict(call.topk_ids)
        phases = (Phase.SEND if recv_hook else Phase.BOTH) | (Phase.CHECKED if checked else 0)
        x = self._apart_from_buffer(call.x)
        outputs = self.kernels.dispatch(x, call.topk_ids, call.topk_weights, call.x_scales, phases)
        if checked:
            own_ids_bad, skipped = self.kernels.wait_verdict()
            if skipped and self.kernels.fatal_pending():
                self.check_errors()  # a verdict that never came: the peer's timeout or mismatch
            if own_ids_bad:
                raise _invalid_ids_error(call.topk_ids, cfg.num_experts, self.ctx.rank)
            if skipped:
                raise self._skipped_error()
        # zero copy: the rows handed out now are read until this rank's combine of them (eager calls:
        # a failed capture must not leave a call behind that never ran; replays are the user's order)
        if host_checks and self.zero_copy:
            self._uncombined = call.epoch
        d = self._dispatched(x, call.x_scales, call.epoch, outputs)
        if not self.ctx.is_full:
            d.inactive_pairs = count_inactive_pairs(call.topk_ids, self.ctx.expert_active)
        if not recv_hook:
            return d, None

        def receive() -> None:
            self.kernels.dispatch_recv(x, call.x_scales, d.handle.outputs)
        return d, receive

    def _unsendable(self, call: DispatchCall) -> Optional[EPError]:
        """What this family cannot send beyond the communicator's checks."""
        if self._uncombined is not None:
            return EPError(f"rank {self.ctx.rank}: zero_copy: dispatch {self._uncombined} has not been combined; its "
                           "rows are views of the receive buffer that this dispatch would overwrite")
        # carried scales only: fp8 takes none and NVFP4's x_scales is its global scale, one float32 (the
        # block scales it makes fit the layout's scale_max by construction)
        if call.x_scales is not None and self.ctx.cfg.quant is None:
            nbytes = call.x_scales.shape[1] * call.x_scales.element_size()
            if nbytes > self.layout.scale_max:
                return EPInputError(f"x_scales rows hold {nbytes} bytes; backend {self.name} carries at most "
                                    f"{self.layout.scale_max} bytes of scales per token (hidden={self.ctx.cfg.hidden})")
        return None

    def _dispatched(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], epoch: int, outputs: tuple) -> Dispatched:
        out_x, out_s, row_ids, row_w, row_slot, counts, dest = outputs
        cfg = self.ctx.cfg
        has_scales = cfg.quant is not None or x_scales is not None
        # NVFP4: the rows were quantised with the caller's global scale, the same on every rank (as the
        # collective backends and the oracle have it), so this rank's is every received row's
        global_scale = x_scales.reshape(1) if cfg.quant == "nvfp4" and x_scales is not None else None
        handle = KernelHandle(row_ids, row_w, row_slot, dest, tuple(outputs[:6]))
        if self.zero_copy:  # the op returned no rows: they stay in the buffer
            out_x = self._rows_in_buffer(self.layout.meta_bytes, out_x)
            out_s = self._rows_in_buffer(self.layout.scale_offset, out_s) if has_scales else out_s
        scales = out_s if has_scales else None
        if cfg.layout == "batched":
            return Dispatched(layout="batched", x=out_x, x_scales=scales, expert_num_tokens=counts,
                              num_tokens=x.shape[0], epoch=epoch, handle=handle, x_global_scale=global_scale)
        return Dispatched(layout="standard", x=out_x, x_scales=scales, topk_ids=row_ids, topk_weights=row_w,
                          num_tokens=x.shape[0], epoch=epoch, handle=handle, x_global_scale=global_scale)

    # -- combine --------------------------------------------------------------------------------------
    def combine(self, call: CombineCall, recv_hook: bool) -> tuple[torch.Tensor, Optional[ReceiveHalf]]:
        compiling = torch.compiler.is_compiling()
        if compiling and self._expert_rows is not None:
            raise EPConfigError("zero_copy", True, "combine reads the expert outputs in place in the buffer, which a "
                                "torch.compile graph cannot order; use eager calls or CUDA graphs")
        host_checks = not compiling and not capturing_graph(self.ctx.device)
        earlier_drops = host_checks and self._before_call()
        if call.dispatched.epoch == self._uncombined:  # done with those rows, combined or abandoned
            self._uncombined = None
        if call.error is not None:
            # the peers' combine kernels see the abort and go on without this rank's part; every
            # rank's next call is a dispatch, so the sequence stays in step (they raise it later)
            self._abandon(call.error, calls=1)
            raise call.error
        d, cfg = call.dispatched, self.ctx.cfg
        out = call.out
        if out is None:
            out = torch.empty(d.num_tokens, cfg.hidden, dtype=cfg.dtype, device=self.ctx.device)
        target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        self._launch_combine(call.expert_out, d, target, Phase.SEND if recv_hook else Phase.BOTH)
        receive: Optional[ReceiveHalf] = None
        if recv_hook:
            def receive() -> None:
                self._launch_combine(call.expert_out, d, target, Phase.RECEIVE)
                if target is not out:
                    out.copy_(target)
        elif target is not out:
            out.copy_(target)
        if earlier_drops:
            self.check_errors()
        return out, receive

    def _launch_combine(self, expert_out: torch.Tensor, d: Dispatched, target: torch.Tensor, phases: int) -> None:
        h: KernelHandle = d.handle
        rows = self._expert_rows
        if rows is not None:  # peers read the rows in place: the kernel is handed the buffer's rows
            if phases & Phase.SEND and not _same_view(expert_out, rows):
                rows.copy_(expert_out)  # (cast to the buffer's dtype)
            expert_out = rows
        self.kernels.combine(expert_out, h.row_ids, h.row_w, h.row_slot, h.dest, target, phases)

    # -- buffers (zero copy) --------------------------------------------------------------------------
    def dispatch_input_buffer(self) -> Optional[torch.Tensor]:
        """Zero copy without fp8 quantisation: this rank's own rows of dispatch half 0 as
        ``[max_tokens_per_rank, hidden]`` of ``cfg.dtype`` (row-strided).  A dispatch of its first T rows
        sends them from where they lie and moves no own rows.  None otherwise."""
        cfg = self.ctx.cfg
        if not self.zero_copy or cfg.quant is not None:
            return None
        if self._input_rows is None:
            like = torch.empty(0, cfg.hidden, dtype=cfg.dtype)
            m, r = cfg.max_tokens_per_rank, self.ctx.rank
            self._input_rows = self._rows_in_buffer(self.layout.meta_bytes, like)[r * m: (r + 1) * m]
        return self._input_rows

    def expert_output_buffer(self, dispatched: Dispatched) -> Optional[torch.Tensor]:
        """Pulling combines: the ``[N, hidden]`` rows of this rank's buffer that combine reads (peers
        over NVLink); experts that write their outputs there save combine a copy.  None otherwise."""
        return self._expert_rows

    def _rows_in_buffer(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """``[world * max_tokens, width]`` of ``like``'s dtype and width: the field at byte ``offset`` of
        every row of dispatch half 0, a row-strided view of this rank's buffer (made once per field)."""
        key = (offset, like.dtype, like.shape[-1])
        view = self._views.get(key)
        if view is None:
            lay, n = self.layout, self.ctx.world_size * self.ctx.cfg.max_tokens_per_rank
            start = lay.dispatch_offset[0]
            rows = self.buffer.local[start: start + n * lay.row_stride].view(n, lay.row_stride)
            nbytes = like.shape[-1] * like.element_size()
            view = self._views[key] = rows[:, offset: offset + nbytes].view(like.dtype)
        return view

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

    # -- errors ---------------------------------------------------------------------------------------
    def _before_call(self) -> bool:
        """Raise a recorded peer problem now (the call must not start: the ranks are out of step).
        Returns whether an earlier call dropped invalid ids: a combine raises that once it has been
        launched, so this rank stays in step with its peers."""
        if self._fatal is not None:
            raise self._fatal
        if self.kernels.fatal_pending():
            self.check_errors()
        return self.kernels.recoverable_pending()

    def _abandon(self, reason: BaseException, calls: int) -> None:
        """Tell the peers this rank gives up its current call without an input verdict (they raise by
        a later call instead of timing out).  A dispatch gives up 2 call numbers, its own and that of
        the combine the peers' hosts are already on their way to; a combine gives up 1.  The ranks stay
        in step either way."""
        if capturing_graph(self.ctx.device) or self._fatal is not None:
            return
        try:
            self.kernels.abort(calls)
        except Exception as exc:  # noqa: BLE001 - the caller's error is the one to report
            self._fatal = EPError(f"rank {self.ctx.rank}: the abort signal could not be sent ({exc}); create a new "
                                  "Communicator")

    def _skipped_error(self) -> EPInputError:
        """The error of a dispatch every rank skipped because some rank's input was bad."""
        code, bad = self.kernels.bad_verdicts(self.ctx.rank)
        what = {1: "input its host refused", 2: "topk_ids out of range", 3: "input its host refused"}
        ranks = "; ".join(f"rank {r}: {what.get(bits, 'bad input')}" for r, bits in sorted(bad.items()))
        return EPInputError(f"rank {self.ctx.rank}: {describe_code(code)} was skipped on every rank because of invalid "
                            f"input on peer rank(s) {sorted(bad)} ({ranks}; their own error says more); this rank's "
                            "input was fine and the communicator stays usable")

    def _naming_lost_ranks(self, error: EPTimeoutError) -> EPTimeoutError:
        """``error`` with the peers known to be gone as ``lost_ranks``: the kernels only see that no signal
        came; the control plane knows whose process has exited (same host) or who closed its end."""
        try:
            gone = self.ctx.control.lost_peers()
        except Exception:  # noqa: BLE001 - the timeout is the error to report, with or without this
            return error
        if not gone:
            return error
        lost = "; ".join(f"rank {r} is gone ({why})" for r, why in sorted(gone.items()))
        return EPTimeoutError(f"{error}; {lost}", missing_ranks=error.missing_ranks, lost_ranks=gone)

    def check_errors(self) -> None:
        """Synchronise, then raise (and clear) whatever the kernels recorded."""
        if self._fatal is not None:
            raise self._fatal
        report = self.kernels.take_record()
        if report.empty:
            return
        cfg = self.ctx.cfg
        error, fatal = error_from(report, last_signalled(report, self.kernels.flag_slots()), self.ctx.rank, self.name,
                                  cfg.timeout_s, self.kernels.num_blocks, cfg.max_tokens_per_rank, cfg.num_experts)
        if isinstance(error, EPTimeoutError):
            error = self._naming_lost_ranks(error)
        if fatal:
            self._fatal = error
        raise error


#: quantisation modes the dispatch kernel fuses; any other is refused before the device is looked at,
#: so ``backend="auto"`` falls to a backend that has it and a named one says why on every machine
FUSED_QUANT = (None, "fp8", "nvfp4")


def quant_unsupported(quant: Optional[str]) -> str:
    """'' when the one-sided dispatch kernel quantises ``quant`` itself, else why not."""
    if quant in FUSED_QUANT:
        return ""
    return f"quant={quant!r} is not fused into the one-sided kernels (they fuse {', '.join(map(repr, FUSED_QUANT))})"


def kernels_unavailable(ctx: BackendContext) -> str:
    """'' when the one-sided kernels can run this config on this rank's device, else why not."""
    if not extension.built():
        return extension.unavailable_reason()
    if ctx.device.type != "cuda":
        return f"needs CUDA tensors (this communicator runs on {ctx.device.type})"
    why = extension.unavailable_reason()
    if why:
        return why
    if ctx.cfg.top_k > Limit.MAX_TOP_K:
        return f"top_k={ctx.cfg.top_k} exceeds the kernels' limit of {Limit.MAX_TOP_K}"
    if ctx.cfg.num_experts > Limit.MAX_EXPERTS:
        return f"num_experts={ctx.cfg.num_experts} exceeds the kernels' limit of {Limit.MAX_EXPERTS}"
    return ""


def _invalid_ids_error(topk_ids: torch.Tensor, num_experts: int, rank: int) -> EPInputError:
    """After the id check said no: the error naming the first offending token (one more sync)."""
    try:
        check_ids(topk_ids, num_experts, rank)
    except EPInputError as exc:
        return exc
    return EPInputError(f"rank {rank}: topk_ids outside [-1, num_experts={num_experts})")




def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is exactly the tensor ``b`` views (address, dtype, shape, strides)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())
