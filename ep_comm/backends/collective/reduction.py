"""The collective family's combine: this rank's float32 partial outputs for every gathered token
(padding masked, so NaN in padding never leaks), in the buffer the reduction collective sums."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...distributed.control import OP_COMBINE
from ..base import BackendContext
from . import kernels
from .error_counts import ErrorCounts
from .packing import GatherHandle, epoch_code
from .scalars import zero


def combine_partial(expert_out: torch.Tensor, handle: GatherHandle, out: torch.Tensor,
                    fused: Optional[bool] = None) -> None:
    """Write this rank's float32 contribution to every gathered token into ``out`` (padding masked).

    ``out`` is ``[R, hidden]`` or ``[world, R / world, hidden]`` (a strided view of a reduction buffer
    with header rows between the chunks); the gathered rows are laid over its leading dims.
    ``fused``: batched layout on CUDA, whether to use the fused kernel (``ep_comm::collective_combine_partial``);
    None picks it whenever the extension has it (``kernels.combine_unavailable()``).
    """
    lead = tuple(out.shape[:-1])
    hidden = expert_out.shape[-1]
    dest = handle.dest
    if dest is None:  # standard: rows are already weighted sums over this rank's experts
        torch.where(handle.row_valid.view(*lead, 1), expert_out.float().reshape(*lead, hidden), zero(out.device),
                    out=out)
        return
    flat = expert_out.reshape(-1, hidden)
    if flat.device.type == "cuda":
        if fused is None:
            fused = not kernels.combine_unavailable()
        if fused:
            kernels.combine_partial(flat, handle, out)
            return
    _combine_partial_torch(flat, dest, handle.local_weights, out)


def _combine_partial_torch(flat: torch.Tensor, dest: torch.Tensor, local_weights: torch.Tensor,
                           out: torch.Tensor) -> None:
    lead = tuple(out.shape[:-1])
    hidden = flat.shape[-1]
    nothing = zero(out.device)
    slots = flat.shape[0]
    k = dest.shape[1]
    valid = dest < slots  # [R, k]
    if flat.device.type == "cpu" and out.dim() == 2:
        # CPU: only the pairs that have an expert here (about k / world of them); a data-dependent
        # size is fine without CUDA graphs, and it is world-fold less work than weighting every pair
        pos = torch.nonzero(valid.reshape(-1)).squeeze(1)
        src = flat.index_select(0, dest.reshape(-1)[pos]).float()
        src.mul_(local_weights.reshape(-1)[pos].unsqueeze(1))
        out.zero_()
        out.index_add_(0, torch.div(pos, k, rounding_mode="floor"), src)
        return
    # static shapes (CUDA graphs without the extension): one gather of every (row, expert) pair in the
    # payload dtype, padding zeroed in place (padding slots may hold NaN), then k fused multiply-adds
    # into the float32 output.  No [R, k, hidden] float32 temporaries; still R·k rows read and the
    # output rewritten k times, which is why CUDA uses the fused kernel when it is built
    rows = flat.index_select(0, dest.clamp_max(slots - 1).reshape(-1))
    rows.masked_fill_(~valid.reshape(-1, 1), 0)
    rows = rows.view(*lead, k, hidden)
    weights = torch.where(valid, local_weights, nothing).view(*lead, k, 1)
    torch.mul(rows[..., 0, :], weights[..., 0, :], out=out)
    for j in range(1, k):
        out.addcmul_(rows[..., j, :], weights[..., j, :])


def reduce_buffer(ctx: BackendContext, rows: Sequence[int], hidden: int, epoch: int, checks: bool):
    """The float32 buffer combine reduces: one chunk of ``rows[d]`` rows per destination rank.

    Returns ``(buffer, chunk_rows, partial_view, has_header)``.  With ``checks`` (graph capture) every
    chunk is followed by a header row carrying, in column ``src``, the sender's (op, epoch) code; after
    the reduction the receiver finds every peer's code in its chunk.  Chunks are equal then (sizes are
    padded to max_tokens_per_rank while capturing), so the partial sums land in one strided view.
    """
    world, device = ctx.group_size, ctx.device
    if not checks or hidden < world or len(set(rows)) != 1:
        buf = torch.empty(sum(rows), hidden, dtype=torch.float32, device=device)
        return buf, list(rows), buf, False
    n = rows[0]
    buf = torch.empty(world, n + 1, hidden, dtype=torch.float32, device=device)
    header = buf[:, n]
    header.zero_()
    header[:, ctx.group_rank].fill_(float(epoch_code(OP_COMBINE, epoch)))  # fill_: no host scalar copy
    return buf.view(world * (n + 1), hidden), [n + 1] * world, buf[:, :n], True


def check_combine_header(counts: ErrorCounts, world: int, chunk: torch.Tensor, epoch: int) -> torch.Tensor:
    """Strip the header row from this rank's reduced chunk, counting mismatching peers on the device."""
    hdr = chunk[-1, :world]
    counts.add(ErrorCounts.EPOCH_MISMATCH, (hdr != float(epoch_code(OP_COMBINE, epoch))).sum())
    return chunk[:-1]
