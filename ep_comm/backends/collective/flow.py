"""The collective family's flow, shared by ``naive`` and ``ag_rs``.

Both move every rank's tokens to every rank (an all-gather of one packed buffer per rank) and bring
partial outputs back with a reduction; they differ only in the collectives, which subclasses give as
three hooks: ``rows_per_rank`` (token slots each rank sends), ``gather`` and ``reduce``.

An eager call packs its local work first, then agrees with the peers on the host (``agreement``),
then exchanges: a local failure so reaches the peers as an error instead of leaving them inside a
collective.  A CUDA-graph capture makes no host round trip; sizes are padded to max_tokens_per_rank
and each message carries an (op, epoch) header checked on the device instead.

The data moves over a group of the communicator's own: gloo on the CPU, NCCL on CUDA devices
(``ControlPlane.gloo_group`` / ``nccl_group``), never the caller's.  The NCCL one is aborted as soon as
the control plane finds a peer lost, which also releases a kernel left waiting for a rank that died
inside a collective; the call that was running, or the next one, or ``check_errors``, then raises
the ``EPTimeoutError`` naming the lost rank, and ``shrink`` builds a new NCCL group over the survivors.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Optional, Sequence, Union

import torch

from ...distributed.control import OP_COMBINE, OP_DISPATCH, OP_EXCHANGE
from ...distributed.groups import is_own_nccl, nccl_error
from ...errors import EPError, EPInputError
from ...layouts import Dispatched
from ...quant import quantize_fp8
from ...quant_nvfp4 import quantize_nvfp4
from ...routing import count_inactive_pairs
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
from .agreement import HostAgreement
from .collectives import carries_cuda_over_nccl
from .error_counts import ErrorCounts
from .invalid_ids import InvalidIds
from .packing import (
    GatherHandle,
    PackLayout,
    RoutedBatch,
    check_dispatch_headers,
    layout_for,
    layouts_for,
    pack,
    unpack,
)
from .reduction import check_combine_header, combine_partial, reduce_buffer
from .selection import select_local


@dataclasses.dataclass
class PreparedDispatch:
    layout: PackLayout
    send: torch.Tensor
    checks: bool  # the buffer carries the device-checked (op, epoch) header
    reports_invalid_ids: bool = False  # the header carries this rank's count of dropped ids


@dataclasses.dataclass
class PreparedCombine:
    buf: torch.Tensor
    chunk_rows: list[int]
    header: bool


class CollectiveBackend(Backend):
    def __init__(self, ctx: BackendContext):
        self.ctx = ctx
        self.counts = ErrorCounts(ctx.device)
        self.invalid_ids = InvalidIds(ctx.cfg, ctx.group_rank, ctx.group_size, ctx.device, self.counts,
                                      ctx.active_ranks)
        self.agreement = HostAgreement(ctx.control)
        self._owns_nccl = is_own_nccl(ctx.group)  # its data group is the control plane's NCCL group
        self._capabilities = Capabilities(host_agreement=ctx.control.agreement)

    # -- what naive and ag_rs differ in -------------------------------------------------------------
    @abc.abstractmethod
    def rows_per_rank(self, batch: RoutedBatch) -> list[int]:
        """Token slots every rank sends."""

    @abc.abstractmethod
    def own_rows(self, batch: RoutedBatch, eager: bool) -> int:
        """Token slots this rank sends, known before the peers' counts are (``rows_per_rank``'s own entry)."""

    @abc.abstractmethod
    def gather(self, send: torch.Tensor, nbytes: list[int]) -> Union[torch.Tensor, Sequence[torch.Tensor]]:
        """Every rank's packed buffer: a list, or one ``[world, nbytes]`` tensor when sizes are equal."""

    @abc.abstractmethod
    def reduce(self, buf: torch.Tensor, chunk_rows: list[int]) -> torch.Tensor:
        """Sum the destination-major float32 chunks over ranks; return this rank's."""

    # -- the interface --------------------------------------------------------------------------------
    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        return Availability(True)

    @classmethod
    def create(cls, ctx: BackendContext) -> CollectiveBackend:
        """The data moves over a group of the communicator's own, not the caller's.  On the CPU a gloo
        group (``gloo_group``) whose timeout is ``timeout_s``, so a survivor left blocked in a
        collective by a lost rank gets out within ``timeout_s`` whatever the caller's group timeout (a
        shrink waits for every survivor, up to 2 × ``timeout_s`` + ``SETTLE_S``).  On a CUDA device
        whose caller's group carries CUDA tensors over NCCL, an NCCL group (``nccl_group``): the
        caller's group is not ours to abort, and only an abort releases a kernel waiting for a rank that
        died.  (CUDA tensors over a caller's gloo group, e.g. ranks sharing a GPU, which NCCL refuses,
        keep that group.)"""
        if ctx.device.type == "cpu":
            ctx = dataclasses.replace(ctx, group=ctx.control.gloo_group("data"))
        elif carries_cuda_over_nccl(ctx.group):
            ctx = dataclasses.replace(ctx, group=ctx.control.nccl_group("data", ctx.device))
        return cls(ctx)

    def shrink(self, ctx: BackendContext) -> CollectiveBackend:
        """The same backend over the survivors, on a group of theirs, so the collectives never include a
        lost rank: their gloo group (``ctx.group``) on the CPU, a new NCCL group over their control plane
        on CUDA (``ctx.control.nccl_group``; it never waits on a lost rank).  This backend's NCCL group
        is aborted first: it includes the lost ranks, and a kernel of it may still wait for one in front
        of the stream the new group uses.  Selection keeps the pairs whose expert this rank owns by
        communicator rank (``ctx.rank``), so the experts of lost ranks are nobody's and their pairs
        vanish; dispatch counts them (``Dispatched.inactive_pairs``).  ``EPError`` for CUDA tensors
        over a caller's gloo group."""
        if self._owns_nccl:
            lost = sorted(set(self.ctx.active_ranks) - set(ctx.active_ranks))
            self.ctx.control.abort_nccl_groups(f"shrinking to ranks {list(ctx.active_ranks)} without {lost}")
            ctx = dataclasses.replace(ctx, group=ctx.control.nccl_group("data", ctx.device))
        elif ctx.device.type != "cpu":
            raise EPError(f"backend {self.name} cannot shrink on {ctx.device} over a gloo group (CUDA tensors on "
                          "a gloo bootstrap): the survivors' group would be gloo; bootstrap over NCCL, one GPU "
                          "per rank")
        return type(self)(ctx)

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    def close(self) -> None:
        """Give the own NCCL group back (``ControlPlane.nccl_group``: a clean shutdown once the device's
        queued work is done, an abort after a loss or when that work does not finish within
        ``timeout_s``); the plane's close ends whatever is left.  Waits on no peer."""
        if self._owns_nccl:
            self.ctx.control.release_nccl_group("data")

    def _raise_if_group_lost(self, op: int, epoch: int, cause: Optional[BaseException] = None) -> None:
        """Raise the control plane's ``EPTimeoutError`` naming the lost ranks once the own NCCL group
        was aborted: what a collective of it produced since (a kernel cut short) is no result."""
        why = self.ctx.control.nccl_aborted if self._owns_nccl else None
        if why is None and self._owns_nccl:
            # torch's watchdog may end a collective waiting for a dead peer (once a peer's group was
            # aborted) before the watcher sees the loss: what it recorded, or an error made of the
            # collective's output (e.g. garbage ids), asks the evidence now
            recorded = nccl_error(self.ctx.group)
            if recorded is not None or cause is not None:
                gone = self.ctx.control.lost_peers()
                why = "; ".join(f"rank {r} is gone ({w})" for r, w in sorted(gone.items())) or None
                if why is None and recorded is not None:
                    why = f"its NCCL group recorded {recorded}"
        if why is not None:
            lost = self.ctx.control.failure(op, epoch, RuntimeError(f"NCCL data group aborted: {why}"))
            raise lost from cause

    def dispatch_input_buffer(self) -> Optional[torch.Tensor]:
        return None

    def expert_output_buffer(self, dispatched: Dispatched) -> Optional[torch.Tensor]:
        return None

    def check_errors(self) -> None:
        try:
            try:  # a lost peer first: after an abort the counts describe cut-short kernels
                self.counts.raise_counted(self.ctx.cfg)
            except EPError as exc:
                self._raise_if_group_lost(OP_EXCHANGE, -1, exc)
                raise
            self._raise_if_group_lost(OP_EXCHANGE, -1)
        finally:
            self.invalid_ids.reset()

    def dispatch(self, call: DispatchCall, recv_hook: bool) -> tuple[Dispatched, Optional[ReceiveHalf]]:
        cfg, capturing = self.ctx.cfg, capturing_graph(self.ctx.device)
        self._raise_if_group_lost(OP_DISPATCH, call.epoch)
        validate = not capturing and cfg.validate_ids
        error = call.error
        if error is None and not capturing and not validate:
            try:
                self.invalid_ids.raise_earlier()
            except EPInputError as exc:
                error = exc
        if error is not None:
            if not capturing:
                self.agreement.agree(OP_DISPATCH, call.epoch, 0, error)
            raise error
        try:  # local work: it reads only this rank's inputs, so it is dropped if a peer reports an error
            ids, weights, merged, header_count = self.invalid_ids.route(call.topk_ids, call.topk_weights,
                                                                        capturing, validate)
            scales: Optional[torch.Tensor]
            global_scale: Optional[torch.Tensor] = None
            if cfg.quant == "fp8":
                payload, scales = quantize_fp8(call.x)
            elif cfg.quant == "nvfp4":  # x_scales is the caller's global scale (validation.py)
                payload, scales, global_scale = quantize_nvfp4(call.x, call.x_scales)
            else:
                payload, scales = call.x.contiguous(), None if call.x_scales is None else call.x_scales.contiguous()
            batch = RoutedBatch(payload, scales, ids, weights, call.epoch, None, merged=merged)
            prepared = self.prepare_dispatch(batch, eager=not capturing, invalid_ids=header_count)
        except EPInputError as exc:
            if not capturing:
                self.agreement.agree(OP_DISPATCH, call.epoch, 0, exc)
            raise
        except BaseException as exc:
            if not capturing:
                self.agreement.tell_peers(OP_DISPATCH, call.epoch, exc)
            raise
        if not capturing:
            batch.peer_tokens = [p.num_tokens for p in self.agreement.agree(OP_DISPATCH, call.epoch,
                                                                             call.x.shape[0])]
        try:
            out = self.exchange_dispatch(batch, prepared, collect_invalid_ids=validate)
        except Exception as exc:
            typed = self.agreement.transport_failure(OP_DISPATCH, call.epoch, exc, capturing)
            if typed is exc:
                raise
            raise typed from exc
        if validate:  # the host waits for the gathered counts here: a loss meanwhile is what it reports
            try:
                self.invalid_ids.raise_if_any(call.topk_ids)
            except EPInputError as exc:
                self._raise_if_group_lost(OP_DISPATCH, call.epoch, exc)
                raise
        self._raise_if_group_lost(OP_DISPATCH, call.epoch)
        out.x_global_scale = global_scale
        if not self.ctx.is_full:
            out.inactive_pairs = count_inactive_pairs(call.topk_ids, self.ctx.expert_active)
        return out, None

    def combine(self, call: CombineCall, recv_hook: bool) -> tuple[torch.Tensor, Optional[ReceiveHalf]]:
        capturing = capturing_graph(self.ctx.device)
        d, cfg = call.dispatched, self.ctx.cfg
        self._raise_if_group_lost(OP_COMBINE, d.epoch if isinstance(d, Dispatched) else -1)
        if call.error is not None:
            if not capturing:
                self.agreement.agree(OP_COMBINE, -1, 0, call.error)
            raise call.error
        try:  # the partial sums are local work: agreed on after it, as in dispatch
            out = call.out
            if out is None:
                out = torch.empty(d.num_tokens, cfg.hidden, dtype=cfg.dtype, device=self.ctx.device)
            prepared = self.prepare_combine(call.expert_out, d)
        except BaseException as exc:
            if not capturing:
                self.agreement.tell_peers(OP_COMBINE, d.epoch, exc)
            raise
        if not capturing:
            self.agreement.agree(OP_COMBINE, d.epoch, d.num_tokens)
        try:
            out = self.exchange_combine(d, out, prepared)
            self._raise_if_group_lost(OP_COMBINE, d.epoch)
            return out, None
        except Exception as exc:
            typed = self.agreement.transport_failure(OP_COMBINE, d.epoch, exc, capturing)
            if typed is exc:
                raise
            raise typed from exc

    # -- the two halves of each op: local work, then the exchange --------------------------------------
    def prepare_dispatch(self, batch: RoutedBatch, eager: bool,
                         invalid_ids: Optional[torch.Tensor] = None) -> PreparedDispatch:
        """Pack this rank's send buffer (local work only).  ``invalid_ids``: the 0-d device count of ids
        this rank sent as -1, reported to every rank in the header."""
        ctx = self.ctx
        checks = capturing_graph(ctx.device)
        mine = layout_for(batch, self.own_rows(batch, eager))
        send = torch.empty(mine.nbytes, dtype=torch.uint8, device=ctx.device)
        pack(batch, mine, send, header=(OP_DISPATCH, ctx.group_rank) if checks else None, invalid_ids=invalid_ids)
        return PreparedDispatch(mine, send, checks, invalid_ids is not None)

    def exchange_dispatch(self, batch: RoutedBatch, prepared: PreparedDispatch,
                          collect_invalid_ids: bool = False) -> Dispatched:
        """The exchange half.  ``collect_invalid_ids``: collect every rank's count of invalid ids from the
        gathered headers (the buffers must have been packed with them)."""
        ctx = self.ctx
        if collect_invalid_ids != prepared.reports_invalid_ids:
            raise EPError("dispatch: collecting invalid-id counts needs buffers packed with them, and only then")
        layouts = layouts_for(batch, self.rows_per_rank(batch))
        if layouts[ctx.group_rank] != prepared.layout:  # the agreed counts contradict what was packed
            raise EPError(f"rank {ctx.rank}: packed {prepared.layout.rows} token slots but the agreed counts say "
                          f"{layouts[ctx.group_rank].rows}")
        g = unpack(self.gather(prepared.send, [lay.nbytes for lay in layouts]), layouts,
                   headers=prepared.checks or collect_invalid_ids)
        if prepared.checks:
            check_dispatch_headers(self.counts, g, OP_DISPATCH, batch.epoch, ctx.cfg.max_tokens_per_rank)
        if collect_invalid_ids:  # queued before the selection: the host's answer need not wait for it
            self.invalid_ids.collect(g.header_words())
        return select_local(ctx, g, batch.num_tokens, batch.epoch, merge=not batch.merged)

    def prepare_combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> PreparedCombine:
        """This rank's float32 partial outputs in the reduction buffer (local work only)."""
        handle: GatherHandle = dispatched.handle
        buf, chunk_rows, partial, header = reduce_buffer(self.ctx, handle.rows, expert_out.shape[-1], dispatched.epoch,
                                                         capturing_graph(self.ctx.device))
        combine_partial(expert_out, handle, partial)
        return PreparedCombine(buf, chunk_rows, header)

    def exchange_combine(self, dispatched: Dispatched, out: torch.Tensor, prepared: PreparedCombine) -> torch.Tensor:
        mine = self.reduce(prepared.buf, prepared.chunk_rows)
        if prepared.header:
            mine = check_combine_header(self.counts, self.ctx.group_size, mine, dispatched.epoch)
        out.copy_(mine[: dispatched.num_tokens])
        return out
