"""Shared data plane of the collective backends (``naive`` and ``ag_rs``).

Both move every rank's tokens to every rank (an all-gather) and bring partial outputs back with a
reduction; they differ only in the collectives (padded all_gather + all_reduce vs. all_gatherv +
reduce_scatterv).  This module holds what they share:

  * one packed byte buffer per rank — header | ids | weights | payload | scales — so a dispatch is a
    single collective whatever the payload dtype (bf16, fp8, packed uint8 ...);
  * selecting this rank's (token, expert) pairs into the standard or batched layout on the device,
    without host synchronisation (CUDA-graph safe);
  * the float32 partial sums for combine, with padding rows masked (NaN in padding never leaks);
  * the (op, epoch) headers that let a graph replay detect a peer on another call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

from ..distributed.control import OP_COMBINE, OP_DISPATCH
from ..errors import EPError
from ..layouts import Dispatched
from . import kernel_ops, select_kernel
from .base import FLAG_EPOCH_MISMATCH, FLAG_TOKEN_OVERFLOW, Availability, BackendContext, RoutedBatch

MAGIC = 0x45504331  # "EPC1"
HEADER_INTS = 8
HEADER_INVALID_IDS = 5  # header word: out-of-range ids this rank sent as -1 (invalid_ids.InvalidIdReport)
ALIGN = 16


class CollectiveBackend:
    """The dispatch/combine flow naive and ag_rs share; they differ only in three hooks:
    ``rows_per_rank`` (token slots each rank sends), ``gather`` (the all-gather) and ``reduce`` (sum the
    destination-major float32 chunks over ranks and return this rank's)."""

    name = ""
    graph_capturable = True

    def __init__(self, ctx: BackendContext):
        self.ctx = ctx

    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        return Availability(True)

    @classmethod
    def create(cls, ctx: BackendContext) -> "CollectiveBackend":
        return cls(ctx)

    def close(self) -> None:
        pass

    def rows_per_rank(self, batch: RoutedBatch) -> list[int]:
        raise NotImplementedError

    def own_rows(self, batch: RoutedBatch, eager: bool) -> int:
        """Token slots this rank sends, known before the peers' counts are (``rows_per_rank``'s own entry)."""
        raise NotImplementedError

    def gather(self, send: torch.Tensor, nbytes: list[int]):
        """Every rank's packed buffer: a list, or one ``[world, nbytes]`` tensor when sizes are equal."""
        raise NotImplementedError

    def reduce(self, buf: torch.Tensor, chunk_rows: list[int]) -> torch.Tensor:
        raise NotImplementedError

    # Each op is split into a local half (no peer involved: it may run while the host agreement is in
    # flight, docs/design.md §10) and the exchange; dispatch()/combine() run both.
    def prepare_dispatch(self, batch: RoutedBatch, eager: bool,
                         invalid_ids: Optional[torch.Tensor] = None) -> "PreparedDispatch":
        """Pack this rank's send buffer (local work only).  ``invalid_ids``: the 0-d device count of ids
        this rank sent as -1, reported to every rank in the header (``InvalidIdReport``)."""
        ctx = self.ctx
        checks = device_checks(ctx)
        mine = layout_for(batch, self.own_rows(batch, eager))
        send = torch.empty(mine.nbytes, dtype=torch.uint8, device=ctx.device)
        pack(batch, mine, send, header=(OP_DISPATCH, ctx.rank) if checks else None, invalid_ids=invalid_ids)
        return PreparedDispatch(mine, send, checks, invalid_ids is not None)

    def dispatch(self, batch: RoutedBatch, prepared: Optional["PreparedDispatch"] = None,
                 report=None) -> Dispatched:
        """The exchange half.  ``report``: an ``invalid_ids.InvalidIdReport`` that collects every rank's
        count of invalid ids from the gathered headers (the buffers must have been packed with them)."""
        ctx = self.ctx
        if prepared is None:
            prepared = self.prepare_dispatch(batch, eager=batch.peer_tokens is not None)
        if (report is not None) != prepared.reports_invalid_ids:
            raise EPError("dispatch: an invalid-id report needs buffers packed with the count, and only then")
        layouts = layouts_for(batch, self.rows_per_rank(batch))
        if layouts[ctx.rank] != prepared.layout:  # the agreed counts contradict what was packed
            raise EPError(f"rank {ctx.rank}: packed {prepared.layout.rows} token slots but the agreed counts say "
                          f"{layouts[ctx.rank].rows}")
        g = unpack(self.gather(prepared.send, [lay.nbytes for lay in layouts]), layouts,
                   headers=prepared.checks or report is not None)
        if prepared.checks:
            check_dispatch_headers(ctx, g, OP_DISPATCH, batch.epoch)
        if report is not None:  # queued before the selection: the host's answer need not wait for it
            report.collect(g.headers)
        return select_local(ctx, g, batch.num_tokens, batch.epoch, merge=not batch.merged)

    def prepare_combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> "PreparedCombine":
        """This rank's float32 partial outputs in the reduction buffer (local work only)."""
        handle: GatherHandle = dispatched.handle
        buf, chunk_rows, partial, header = reduce_buffer(self.ctx, handle.rows, expert_out.shape[-1], dispatched.epoch)
        combine_partial(expert_out, handle, partial)
        return PreparedCombine(buf, chunk_rows, header)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: torch.Tensor,
                prepared: Optional["PreparedCombine"] = None) -> torch.Tensor:
        ctx = self.ctx
        if prepared is None:
            prepared = self.prepare_combine(expert_out, dispatched)
        mine = self.reduce(prepared.buf, prepared.chunk_rows)
        if prepared.header:
            mine = check_combine_header(ctx, mine, dispatched.epoch)
        out.copy_(mine[: dispatched.num_tokens])
        return out


@dataclasses.dataclass
class PreparedDispatch:
    layout: "PackLayout"
    send: torch.Tensor
    checks: bool  # the buffer carries the device-checked (op, epoch) header
    reports_invalid_ids: bool = False  # the header carries this rank's count of dropped ids


@dataclasses.dataclass
class PreparedCombine:
    buf: torch.Tensor
    chunk_rows: list[int]
    header: bool


_EARLIER: dict = {}


def _earlier(k: int, device: torch.device) -> torch.Tensor:
    """``[k, k]`` bool, True below the diagonal: slot j comes before slot i (made once per k and device;
    only eager calls use it, never a graph capture)."""
    key = (k, device)
    earlier = _EARLIER.get(key)
    if earlier is None:
        earlier = _EARLIER[key] = torch.ones(k, k, dtype=torch.bool, device=device).tril(diagonal=-1)
    return earlier


def device_checks(ctx: BackendContext) -> bool:
    """Whether messages carry (op, epoch) headers checked on the device.

    Only while capturing a CUDA graph: in eager mode the host control plane has already agreed on
    (op, epoch) with every peer before any data moves, so headers would be redundant work.
    """
    return ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def epoch_code(op: int, epoch: int) -> int:
    """A small positive int that is exact in float32 (combine headers ride in fp32 sums)."""
    return (((epoch % (1 << 20)) << 2) | (op & 3)) + 1


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """Byte offsets of the per-rank packed buffer for ``rows`` token slots (computed once per object;
    ``layout_for`` hands out one object per shape)."""

    rows: int
    top_k: int
    x_shape_tail: tuple[int, ...]
    x_dtype: torch.dtype
    s_width: int
    s_dtype: Optional[torch.dtype]

    @functools.cached_property
    def x_row_bytes(self) -> int:
        n = 1
        for d in self.x_shape_tail:
            n *= d
        return n * self.x_dtype.itemsize

    @functools.cached_property
    def s_row_bytes(self) -> int:
        return 0 if self.s_dtype is None else self.s_width * self.s_dtype.itemsize

    @functools.cached_property
    def ids_off(self) -> int:
        return _align(HEADER_INTS * 4)

    @functools.cached_property
    def w_off(self) -> int:
        return self.ids_off + _align(self.rows * self.top_k * 4)

    @functools.cached_property
    def x_off(self) -> int:
        return self.w_off + _align(self.rows * self.top_k * 4)

    @functools.cached_property
    def s_off(self) -> int:
        return self.x_off + _align(self.rows * self.x_row_bytes)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.s_off + _align(self.rows * self.s_row_bytes)


def layout_for(batch: RoutedBatch, rows: int) -> PackLayout:
    return layouts_for(batch, (rows,))[0]


def layouts_for(batch: RoutedBatch, rows: Sequence[int]) -> list[PackLayout]:
    """The layout of a buffer of ``n`` token slots of ``batch``'s shape, for each ``n`` in ``rows``."""
    s = batch.x_scales
    shape = (batch.topk_ids.shape[1], tuple(batch.x.shape[1:]), batch.x.dtype,
             0 if s is None else s.shape[1], None if s is None else s.dtype)
    return [_layout(n, *shape) for n in rows]


@functools.lru_cache(maxsize=1024)
def _layout(*fields) -> PackLayout:
    # one object per shape: a dispatch asks for world + 1 layouts, and their offsets are Python
    # arithmetic (24 µs per EP8 dispatch on the CPU before)
    return PackLayout(*fields)


def pack(batch: RoutedBatch, layout: PackLayout, out: torch.Tensor,
         header: Optional[tuple[int, int]] = None, invalid_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write ``batch`` into the uint8 buffer ``out [layout.nbytes]``; slots past T are padding (ids -1).

    ``header``: ``(op, rank)`` to stamp the (op, epoch, T) header (see ``device_checks``), or None.
    ``invalid_ids``: a 0-d device count for the header's ``HEADER_INVALID_IDS`` word
    (``invalid_ids.InvalidIdReport``).
    """
    t, rows, k = batch.num_tokens, layout.rows, layout.top_k
    if header is not None:
        # scalar fills, not a host tensor copy: a pageable H2D copy is illegal while capturing
        words = out[: HEADER_INTS * 4].view(torch.int32)
        op, rank = header
        for i, value in enumerate((MAGIC, op, batch.epoch % (1 << 31), t, rank, 0, 0, 0)):
            words[i].fill_(value)
    if invalid_ids is not None:  # a device-to-device copy: no sync, and legal while capturing
        out[: HEADER_INTS * 4].view(torch.int32)[HEADER_INVALID_IDS].copy_(invalid_ids)
    ids = out[layout.ids_off: layout.ids_off + rows * k * 4].view(torch.int32).view(rows, k)
    ids[:t].copy_(batch.topk_ids)
    w = out[layout.w_off: layout.w_off + rows * k * 4].view(torch.float32).view(rows, k)
    w[:t].copy_(batch.topk_weights)
    if t < rows:  # padding slots (none in an eager ag_rs call)
        ids[t:].fill_(-1)
        w[t:].zero_()
    if t:
        xb = out[layout.x_off: layout.x_off + t * layout.x_row_bytes]
        xb.copy_(batch.x.reshape(t, -1).view(torch.uint8).reshape(-1))
        if batch.x_scales is not None:
            sb = out[layout.s_off: layout.s_off + t * layout.s_row_bytes]
            sb.copy_(batch.x_scales.contiguous().view(torch.uint8).reshape(-1))
    return out


@dataclasses.dataclass
class Gathered:
    """All ranks' tokens concatenated rank-major: rows ``[offsets[r], offsets[r] + rows[r])`` are rank r's."""

    # [R, k], or [world, R / world, k] strided views of the gathered buffer when every rank sent as many
    # rows (selection reads them in place: no copy)
    ids: torch.Tensor  # int32 global ids (-1 padding)
    weights: torch.Tensor  # float32
    x: torch.Tensor  # [R, *tail] payload dtype
    x_scales: Optional[torch.Tensor]  # [R, S]
    rows: list[int]
    headers: Optional[torch.Tensor]  # [world, HEADER_INTS] int32 (meaningful only when device_checks)


def unpack(buffers, layouts: Sequence[PackLayout], headers: bool = True) -> Gathered:
    """Every rank's packed buffer (a list, or one ``[world, nbytes]`` tensor when sizes are equal) as
    rank-major tensors: one copy per field.  ``headers``: also collect the (op, epoch) headers."""
    if isinstance(buffers, torch.Tensor):
        lay = layouts[0]
        n, k, world = lay.rows, lay.top_k, buffers.shape[0]

        def field(off: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
            return buffers[:, off: off + nbytes].view(dtype)  # [world, per-rank elements], strided
        s = None
        if lay.s_dtype is not None:
            s = field(lay.s_off, n * lay.s_row_bytes, lay.s_dtype).reshape(world * n, lay.s_width)
        return Gathered(
            ids=field(lay.ids_off, n * k * 4, torch.int32).view(world, n, k),
            weights=field(lay.w_off, n * k * 4, torch.float32).view(world, n, k),
            x=field(lay.x_off, n * lay.x_row_bytes, lay.x_dtype).reshape(world * n, *lay.x_shape_tail),
            x_scales=s,
            rows=[n] * world,
            headers=field(0, HEADER_INTS * 4, torch.int32) if headers else None,
        )
    ids, ws, xs, ss, hdrs = [], [], [], [], []
    for buf, lay in zip(buffers, layouts):
        n, k = lay.rows, lay.top_k
        hdrs.append(buf[: HEADER_INTS * 4].view(torch.int32))
        ids.append(buf[lay.ids_off: lay.ids_off + n * k * 4].view(torch.int32).view(n, k))
        ws.append(buf[lay.w_off: lay.w_off + n * k * 4].view(torch.float32).view(n, k))
        xs.append(buf[lay.x_off: lay.x_off + n * lay.x_row_bytes].view(lay.x_dtype).view(n, *lay.x_shape_tail))
        if lay.s_dtype is not None:
            ss.append(buf[lay.s_off: lay.s_off + n * lay.s_row_bytes].view(lay.s_dtype).view(n, lay.s_width))
    return Gathered(
        ids=torch.cat(ids),
        weights=torch.cat(ws),
        x=torch.cat(xs),
        x_scales=torch.cat(ss) if ss else None,
        rows=[lay.rows for lay in layouts],
        headers=torch.stack(hdrs) if headers else None,
    )


def check_dispatch_headers(ctx: BackendContext, g: Gathered, op: int, epoch: int) -> None:
    """Count (on the device, no sync) peers whose header shows another call or too many tokens."""
    h = g.headers
    bad = (h[:, 0] != MAGIC) | (h[:, 1] != op) | (h[:, 2] != epoch % (1 << 31))
    ctx.error_flags[FLAG_EPOCH_MISMATCH] += bad.sum()
    ctx.error_flags[FLAG_TOKEN_OVERFLOW] += (h[:, 3] > ctx.cfg.max_tokens_per_rank).sum()


@dataclasses.dataclass
class GatherHandle:
    """What combine needs from a dispatch of the collective backends."""

    rows: list[int]  # rows per source rank in the gathered order
    row_valid: torch.Tensor  # [R] bool: the row has at least one expert on this rank
    dest: Optional[torch.Tensor]  # [R, k] int64 flat slot in [L*capacity] (batched); >= L*capacity: none
    local_weights: torch.Tensor  # [R, k] float32, 0 where the expert is not on this rank


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """2-D rows reinterpreted as the widest integer words that divide a row (index_copy moves one
    element per thread: bytes would be 8x slower than int64 words)."""
    raw = rows.contiguous().view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        if raw.shape[1] % dtype.itemsize == 0:
            return raw.view(dtype)
    return raw


def select_local(ctx: BackendContext, g: Gathered, num_tokens: int, epoch: int, merge: bool = False,
                 kernel: Optional[bool] = None) -> Dispatched:
    """Turn all ranks' tokens into this rank's ``Dispatched`` in the configured layout (no host sync).

    The gathered ids are -1 or valid global ids.  ``merge``: they may still repeat an expert within a
    token's row (eager calls send the caller's ids as they are): the routing guard then happens here,
    on the local pairs, keeping each expert in its first slot with the row's weights for it summed.
    That is the same result as merging before sending, in fewer kernels (the guard and the selection
    share their work); CUDA-graph captures merge on the sender (``sanitize_routing``, which also counts
    invalid ids) and pass ``merge=False``.  ``kernel``: on CUDA, whether to select with the extension's
    kernels (``select_kernel``; they always merge); None uses them whenever they are built.
    """
    if g.ids.device.type == "cuda" and kernel is not False:
        if not select_kernel.unavailable():
            return select_kernel.select(ctx, g, num_tokens, epoch)
        if kernel:
            raise EPError(f"the collective selection kernels cannot run: {select_kernel.unavailable()}")
    cfg, L, cap = ctx.cfg, ctx.num_local_experts, ctx.capacity
    first = ctx.rank * L
    # the owner of id i is i // L (contiguous blocks); -1 // L = -1 is nobody's
    is_local = torch.div(g.ids, L, rounding_mode="floor") == ctx.rank
    dev, k = g.ids.device, g.ids.shape[-1]
    zero = _zero(dev)
    weights = g.weights
    if merge:
        same = g.ids.unsqueeze(-1) == g.ids.unsqueeze(-2)  # [..., k, k]: slots i and j hold one id
        repeat = (same & _earlier(k, dev)).any(dim=-1)
        is_local = is_local > repeat  # local and the expert's first slot: bool ">" is "and not"
        # -1 slots match each other only; they are never local, so their sums are never read
        weights = torch.where(same, g.weights.unsqueeze(-2), zero).sum(dim=-1)
    # the results are fresh contiguous tensors, so the [R, k] reshapes are views
    local_ids = torch.where(is_local, g.ids - first, _const(-1, torch.int32, dev)).reshape(-1, k)  # int32
    local_w = torch.where(is_local, weights, zero).reshape(-1, k)
    row_valid = is_local.any(dim=-1).reshape(-1)

    if cfg.layout == "standard":
        handle = GatherHandle(g.rows, row_valid, None, local_w)
        return Dispatched(
            layout="standard", x=g.x, x_scales=g.x_scales, topk_ids=local_ids,
            topk_weights=local_w, num_tokens=num_tokens, epoch=epoch, handle=handle,
        )

    # batched: slot of each (row, expert) pair = how many earlier pairs (row-major) chose that expert.
    # The running count is an inclusive scan along the *last* dim of an expert-major one-hot: torch
    # scans an outer dim with one sequential thread per column (measured 26 ms at 4096 tokens, H200).
    r, k = local_ids.shape
    pair_expert = local_ids.reshape(-1).to(torch.int64)  # slot arithmetic and scatter/gather indices
    valid_pairs = pair_expert >= 0
    expert_of_pair = pair_expert.clamp_min(0).unsqueeze(0)  # [1, R*k]
    onehot = torch.zeros(L, r * k, dtype=torch.int32, device=g.ids.device)
    onehot.scatter_(0, expert_of_pair, valid_pairs.to(torch.int32).unsqueeze(0))
    running = torch.cumsum(onehot, dim=1)  # [L, R*k]
    slot = torch.gather(running, 0, expert_of_pair).squeeze(0) - 1
    # pairs that go nowhere land in a per-row trash row, so index_copy_ never sees duplicate indices
    # (whose result torch leaves unspecified)
    dummy = L * cap
    trash = dummy + torch.arange(r, device=g.ids.device).repeat_interleave(k)
    dest = torch.where(valid_pairs, pair_expert * cap + slot, trash).to(torch.int64)
    dest = dest.view(r, k)
    expert_num_tokens = running[:, -1].to(torch.int32) if r * k else torch.zeros(L, dtype=torch.int32, device=g.ids.device)

    # move rows as raw bytes: works for every payload dtype (fp8 has no index_copy kernel on CPU)
    tail = tuple(g.x.shape[1:])
    row_elems = 1
    for dim in tail:
        row_elems *= dim
    x_bytes = _as_words(g.x.reshape(r, row_elems))
    s_bytes = None if g.x_scales is None else _as_words(g.x_scales)
    if g.x.device.type == "cpu":
        # CPU: copy only the pairs that have an expert here (about k / world of the R·k pairs; no CUDA
        # graph needs a static size here), straight into the [L·capacity] slots without trash rows
        pos = torch.nonzero(valid_pairs).squeeze(1)
        slots, src = dest.reshape(-1)[pos], torch.div(pos, k, rounding_mode="floor")
        x_b = torch.empty((dummy, x_bytes.shape[1]), dtype=x_bytes.dtype, device=g.x.device)
        x_b.index_copy_(0, slots, x_bytes.index_select(0, src))
        s_b = None
        if s_bytes is not None:
            s_b = torch.empty((dummy, s_bytes.shape[1]), dtype=s_bytes.dtype, device=g.x.device)
            s_b.index_copy_(0, slots, s_bytes.index_select(0, src))
    else:
        x_b = torch.empty((dummy + r, x_bytes.shape[1]), dtype=x_bytes.dtype, device=g.x.device)
        s_b = None
        if s_bytes is not None:
            s_b = torch.empty((dummy + r, s_bytes.shape[1]), dtype=s_bytes.dtype, device=g.x.device)
        for j in range(k):
            x_b.index_copy_(0, dest[:, j], x_bytes)
            if s_b is not None:
                s_b.index_copy_(0, dest[:, j], s_bytes)
    x_out = x_b[:dummy].view(torch.uint8).view(g.x.dtype).view(L, cap, *tail)
    s_out = None if s_b is None else s_b[:dummy].view(torch.uint8).view(g.x_scales.dtype).view(L, cap, -1)
    handle = GatherHandle(g.rows, row_valid, dest, local_w)
    return Dispatched(
        layout="batched", x=x_out, x_scales=s_out,
        expert_num_tokens=expert_num_tokens, num_tokens=num_tokens, epoch=epoch, handle=handle,
    )


def combine_partial(expert_out: torch.Tensor, handle: GatherHandle, out: torch.Tensor,
                    fused: Optional[bool] = None) -> None:
    """Write this rank's float32 contribution to every gathered token into ``out`` (padding masked).

    ``out`` is ``[R, hidden]`` or ``[world, R / world, hidden]`` (a strided view of a reduction buffer
    with header rows between the chunks); the gathered rows are laid over its leading dims.
    ``fused``: batched layout on CUDA, whether to use the fused kernel (``ep_comm::collective_combine_partial``);
    None picks it whenever the extension has it (``fused_combine_unavailable()``).
    """
    lead = tuple(out.shape[:-1])
    hidden = expert_out.shape[-1]
    if handle.dest is None:  # standard: rows are already weighted sums over this rank's experts
        torch.where(handle.row_valid.view(*lead, 1), expert_out.float().reshape(*lead, hidden), _zero(out.device),
                    out=out)
        return
    flat = expert_out.reshape(-1, hidden)
    if flat.device.type == "cuda":
        if fused is None:
            fused = not fused_combine_unavailable()
        if fused:
            _combine_partial_fused(flat, handle, out)
            return
    _combine_partial_torch(flat, handle, out)


def fused_combine_unavailable() -> str:
    """'' when batched combine on CUDA runs the fused kernel, else why it runs torch ops instead
    (``EP_COMM_COLLECTIVE_COMBINE=torch`` keeps the torch ops)."""
    return kernel_ops.collective_op_reason("collective_combine_partial", "EP_COMM_COLLECTIVE_COMBINE")


def _combine_partial_fused(flat: torch.Tensor, handle: GatherHandle, out: torch.Tensor) -> None:
    """One kernel: per gathered row, read only the local pairs' rows, weight and sum them in float32
    and write the row once (padding never read, rows without a local pair written as zeros)."""
    why = fused_combine_unavailable()
    if why:
        raise EPError(f"the fused collective combine kernel cannot run: {why}")
    # checked here too, not only by the op: on nvidia-h200-x2 the op's own refusal (TORCH_CHECK) of
    # these arguments crashed the test process once under pytest (open: bench/NOTES.md)
    if handle.dest.dtype != torch.int64 or handle.dest.dim() != 2:
        raise EPError(f"collective combine kernel cannot run: dest must be int64 [rows, k], got "
                      f"{handle.dest.dtype} {tuple(handle.dest.shape)}")
    if out.shape[-1] != flat.shape[-1]:
        raise EPError(f"collective combine kernel cannot run: out has width {out.shape[-1]}, expert_out "
                      f"{flat.shape[-1]}")
    try:
        torch.ops.ep_comm.collective_combine_partial(flat, handle.dest, handle.local_weights, out)
    except RuntimeError as exc:  # a launch failure or a shape the op refuses: typed, with the cause
        raise EPError(f"collective combine kernel failed: {exc}") from exc


_CONSTS: dict = {}


def _const(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor on ``device``, made once.  ``torch.where`` turns a Python scalar into a fresh
    device tensor on every call (a fill kernel each on CUDA), and where(out=) takes none at all."""
    key = (value, dtype, device)
    c = _CONSTS.get(key)
    if c is None:
        c = torch.full((), value, dtype=dtype, device=device)
        # one made while a CUDA graph is captured holds its value only inside replays (and lives in
        # the graph's memory pool): use it for this call, never keep it
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _CONSTS[key] = c
    return c


def _zero(device: torch.device) -> torch.Tensor:
    return _const(0.0, torch.float32, device)


def _combine_partial_torch(flat: torch.Tensor, handle: GatherHandle, out: torch.Tensor) -> None:
    lead = tuple(out.shape[:-1])
    hidden = flat.shape[-1]
    zero = _zero(out.device)
    slots = flat.shape[0]
    k = handle.dest.shape[1]
    valid = handle.dest < slots  # [R, k]
    if flat.device.type == "cpu" and out.dim() == 2:
        # CPU: only the pairs that have an expert here (about k / world of them); a data-dependent
        # size is fine without CUDA graphs, and it is world-fold less work than weighting every pair
        pos = torch.nonzero(valid.reshape(-1)).squeeze(1)
        src = flat.index_select(0, handle.dest.reshape(-1)[pos]).float()
        src.mul_(handle.local_weights.reshape(-1)[pos].unsqueeze(1))
        out.zero_()
        out.index_add_(0, torch.div(pos, k, rounding_mode="floor"), src)
        return
    # static shapes (CUDA graphs without the extension): one gather of every (row, expert) pair in the
    # payload dtype, padding zeroed in place (padding slots may hold NaN), then k fused multiply-adds
    # into the float32 output.  No [R, k, hidden] float32 temporaries; still R·k rows read and the
    # output rewritten k times, which is why CUDA uses the fused kernel when it is built
    rows = flat.index_select(0, handle.dest.clamp_max(slots - 1).reshape(-1))
    rows.masked_fill_(~valid.reshape(-1, 1), 0)
    rows = rows.view(*lead, k, hidden)
    weights = torch.where(valid, handle.local_weights, zero).view(*lead, k, 1)
    torch.mul(rows[..., 0, :], weights[..., 0, :], out=out)
    for j in range(1, k):
        out.addcmul_(rows[..., j, :], weights[..., j, :])


def reduce_buffer(ctx: BackendContext, rows: Sequence[int], hidden: int, epoch: int):
    """The float32 buffer combine reduces: one chunk of ``rows[d]`` rows per destination rank.

    Returns ``(buffer, chunk_rows, partial_view, has_header)``.  With ``device_checks`` every chunk is
    followed by a header row carrying, in column ``src``, the sender's (op, epoch) code; after the
    reduction the receiver finds every peer's code in its chunk.  Chunks are equal then (sizes are
    padded to max_tokens_per_rank while capturing), so the partial sums land in one strided view.
    """
    world, device = ctx.world_size, ctx.device
    if not device_checks(ctx) or hidden < world or len(set(rows)) != 1:
        buf = torch.empty(sum(rows), hidden, dtype=torch.float32, device=device)
        return buf, list(rows), buf, False
    n = rows[0]
    buf = torch.empty(world, n + 1, hidden, dtype=torch.float32, device=device)
    header = buf[:, n]
    header.zero_()
    header[:, ctx.rank].fill_(float(epoch_code(OP_COMBINE, epoch)))  # fill_: no host scalar copy
    return buf.view(world * (n + 1), hidden), [n + 1] * world, buf[:, :n], True


def check_combine_header(ctx: BackendContext, chunk: torch.Tensor, epoch: int) -> torch.Tensor:
    """Strip the header row from this rank's reduced chunk, counting mismatching peers on the device."""
    hdr = chunk[-1, : ctx.world_size]
    ctx.error_flags[FLAG_EPOCH_MISMATCH] += (hdr != float(epoch_code(OP_COMBINE, epoch))).sum()
    return chunk[:-1]
