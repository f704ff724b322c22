"""Turning every rank's gathered tokens into this rank's ``Dispatched`` (standard or batched layout),
on the device and without host synchronisation (CUDA-graph safe).  On CUDA the extension's kernels do
it (``kernels.select``); these torch ops are the CPU path and the reference the kernels are checked
against."""
from __future__ import annotations

from typing import Optional

import torch

from ...errors import EPError
from ...layouts import Dispatched
from ..base import BackendContext
from . import kernels
from .packing import Gathered, GatherHandle
from .scalars import const, zero

_EARLIER: dict = {}


def _earlier(k: int, device: torch.device) -> torch.Tensor:
    """``[k, k]`` bool, True below the diagonal: slot j comes before slot i (made once per k and device;
    only eager calls use it, never a graph capture)."""
    key = (k, device)
    earlier = _EARLIER.get(key)
    if earlier is None:
        earlier = _EARLIER[key] = torch.ones(k, k, dtype=torch.bool, device=device).tril(diagonal=-1)
    return earlier


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
    kernels (``kernels.select``; they always merge); None uses them whenever they are built.
    """
    if g.ids.device.type == "cuda" and kernel is not False:
        if not kernels.select_unavailable():
            return kernels.select(ctx, g, num_tokens, epoch)
        if kernel:
            raise EPError(f"the collective selection kernels cannot run: {kernels.select_unavailable()}")
    cfg, L, cap = ctx.cfg, ctx.num_local_experts, ctx.capacity
    first = ctx.rank * L
    # the owner of id i is i // L (contiguous blocks); -1 // L = -1 is nobody's.  ctx.rank is the
    # communicator rank, so after a shrink the experts of lost ranks are nobody's either: skipped
    is_local = torch.div(g.ids, L, rounding_mode="floor") == ctx.rank
    dev, k = g.ids.device, g.ids.shape[-1]
    nothing = zero(dev)
    weights = g.weights
    if merge:
        same = g.ids.unsqueeze(-1) == g.ids.unsqueeze(-2)  # [..., k, k]: slots i and j hold one id
        repeat = (same & _earlier(k, dev)).any(dim=-1)
        is_local = is_local > repeat  # local and the expert's first slot: bool ">" is "and not"
        # -1 slots match each other only; they are never local, so their sums are never read
        weights = torch.where(same, g.weights.unsqueeze(-2), nothing).sum(dim=-1)
    # the results are fresh contiguous tensors, so the [R, k] reshapes are views
    local_ids = torch.where(is_local, g.ids - first, const(-1, torch.int32, dev)).reshape(-1, k)  # int32
    local_w = torch.where(is_local, weights, nothing).reshape(-1, k)
    row_valid = is_local.any(dim=-1).reshape(-1)

    if cfg.layout == "standard":
        handle = GatherHandle(g.rows, row_valid, None, local_w)
        return Dispatched(
            layout="standard", x=g.x, x_scales=g.x_scales, topk_ids=local_ids,
            topk_weights=local_w, num_tokens=num_tokens, epoch=epoch, handle=handle,
        )

    # batched: slot of each (row, expert) pair = how many earlier pairs (row-major) chose that expert.
    # The running count is an inclusive scan along the *last* dim of an expert-major one-hot: torch
    # scans an outer dim with one sequential thread per column, far slower at prefill sizes.
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
    expert_num_tokens = (running[:, -1].to(torch.int32) if r * k
                         else torch.zeros(L, dtype=torch.int32, device=g.ids.device))

    # move rows as raw bytes: works for every payload dtype (fp8 has no index_copy kernel on CPU)
    tail = tuple(g.x.shape[1:])
    row_elems = 1
    for dim in tail:
        row_elems *= dim
    if g.x.device.type == "cpu":
        # CPU: copy only the pairs that have an expert here (about k / world of the R·k pairs; no CUDA
        # graph needs a static size here), straight into the [L·capacity] slots without trash rows
        pos = torch.nonzero(valid_pairs).squeeze(1)
        slots, src = dest.reshape(-1)[pos], torch.div(pos, k, rounding_mode="floor")

        def place(words: torch.Tensor) -> torch.Tensor:
            """``words`` (one per gathered row) copied into the ``[L·capacity, width]`` slots of its pairs."""
            out = torch.empty((dummy, words.shape[1]), dtype=words.dtype, device=g.x.device)
            out.index_copy_(0, slots, words.index_select(0, src))
            return out
    else:
        def place(words: torch.Tensor) -> torch.Tensor:
            """As on the CPU, from every pair: those that go nowhere write their row's trash slot (cut off)."""
            out = torch.empty((dummy + r, words.shape[1]), dtype=words.dtype, device=g.x.device)
            for j in range(k):
                out.index_copy_(0, dest[:, j], words)
            return out[:dummy]
    x_out = place(_as_words(g.x.reshape(r, row_elems))).view(torch.uint8).view(g.x.dtype).view(L, cap, *tail)
    s_out = None
    if g.x_scales is not None:
        s_out = place(_as_words(g.x_scales)).view(torch.uint8).view(g.x_scales.dtype).view(L, cap, -1)
    handle = GatherHandle(g.rows, row_valid, dest, local_w)
    return Dispatched(
        layout="batched", x=x_out, x_scales=s_out,
        expert_num_tokens=expert_num_tokens, num_tokens=num_tokens, epoch=epoch, handle=handle,
    )
