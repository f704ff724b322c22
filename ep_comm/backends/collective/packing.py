"""The collective family's wire format: every rank's tokens in one packed byte buffer.

Dispatch is a single collective whatever the payload dtype (bf16, fp8, packed uint8 ...): each rank
packs header | ids | weights | payload | scales into one buffer, the all-gather moves them, and
``unpack`` lays every rank's fields side by side again (views of the gathered bytes where sizes are
equal).  The header carries (op, epoch, T) for the device-side call check of CUDA-graph replays and
the count of ids this rank sent as -1 (``invalid_ids``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import torch

from ...errors import EPError
from .error_counts import ErrorCounts

MAGIC = 0x45504331  # "EPC1"
HEADER_INTS = 8
HEADER_INVALID_IDS = 5  # header word: out-of-range ids this rank sent as -1 (invalid_ids.InvalidIds)
ALIGN = 16


@dataclasses.dataclass
class RoutedBatch:
    """One rank's dispatch input after validation, the routing guard and quantisation.

    ``x [T, W]`` payload (any dtype, row-contiguous), ``x_scales [T, S]`` or None, ``topk_ids [T, k]``
    int32/int64 global ids, -1 or valid, ``topk_weights [T, k]`` float32.  ``merged``: duplicates are
    already merged (weights summed into the first slot, 0 on -1 slots); when False (eager calls) the
    receiver merges them while it selects its pairs.  ``peer_tokens`` holds every rank's T when the
    host agreement exchanged it (eager mode) and None while capturing a CUDA graph (sizes must then
    be static).
    """

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    epoch: int
    peer_tokens: Optional[Sequence[int]]
    merged: bool = True

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]


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
    # arithmetic worth caching on the eager path
    return PackLayout(*fields)


def pack(batch: RoutedBatch, layout: PackLayout, out: torch.Tensor,
         header: Optional[tuple[int, int]] = None, invalid_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write ``batch`` into the uint8 buffer ``out [layout.nbytes]``; slots past T are padding (ids -1).

    ``header``: ``(op, rank)`` to stamp the (op, epoch, T) header (see ``device_checks``), or None.
    ``invalid_ids``: a 0-d device count for the header's ``HEADER_INVALID_IDS`` word
    (``invalid_ids.InvalidIds``).
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

    def header_words(self) -> torch.Tensor:
        """``headers``, which ``unpack`` collects when asked to (``headers=True``)."""
        if self.headers is None:
            raise EPError("the gathered buffers were unpacked without their headers")
        return self.headers


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


def check_dispatch_headers(counts: ErrorCounts, g: Gathered, op: int, epoch: int, max_tokens: int) -> None:
    """Count (on the device, no sync) peers whose header shows another call or too many tokens."""
    h = g.header_words()
    bad = (h[:, 0] != MAGIC) | (h[:, 1] != op) | (h[:, 2] != epoch % (1 << 31))
    counts.add(ErrorCounts.EPOCH_MISMATCH, bad.sum())
    counts.add(ErrorCounts.TOKEN_OVERFLOW, (h[:, 3] > max_tokens).sum())


@dataclasses.dataclass
class GatherHandle:
    """What combine needs from a dispatch of the collective backends."""

    rows: list[int]  # rows per source rank in the gathered order
    row_valid: torch.Tensor  # [R] bool: the row has at least one expert on this rank
    dest: Optional[torch.Tensor]  # [R, k] int64 flat slot in [L*capacity] (batched); >= L*capacity: none
    local_weights: torch.Tensor  # [R, k] float32, 0 where the expert is not on this rank
