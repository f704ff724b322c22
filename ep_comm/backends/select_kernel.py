"""The collective backends' layout selection as CUDA kernels.

``ep_comm::collective_select_local`` and ``ep_comm::collective_scatter_rows`` (csrc/collective/select_local.h)
turn the all-gathered token table into this rank's ``Dispatched`` in two launches (standard layout) or
three (batched: local ids and weights, slots per expert, rows copied into their slots), where the
torch path of ``gathered.select_local`` issues about 12 and 35 small ops, each ~10 µs of host time on
the GPU machines.  Same results as that torch path, which stays for CPUs and for builds without these
ops (tests/backends/test_collective_select_kernel.py compares the two).
"""
from __future__ import annotations

import torch

from ..errors import EPError
from ..layouts import Dispatched
from . import kernel_ops


def unavailable() -> str:
    """'' when selection on CUDA runs the kernels, else why it runs torch ops
    (``EP_COMM_COLLECTIVE_SELECT=torch`` keeps the torch ops)."""
    return kernel_ops.collective_op_reason("collective_select_local", "EP_COMM_COLLECTIVE_SELECT")


def select(ctx, g, num_tokens: int, epoch: int) -> Dispatched:
    """``gathered.select_local`` on CUDA in kernels (duplicates always merged: on ids the sender already
    merged that changes nothing).  ``g``: a ``gathered.Gathered`` of int32 ids / float32 weights."""
    from .gathered import GatherHandle  # imported here: gathered imports this module at its top

    cfg, num_local, capacity = ctx.cfg, ctx.num_local_experts, ctx.capacity
    k = g.ids.shape[-1]
    rows = g.ids.numel() // k if k else 0
    dev = g.ids.device
    local_ids = torch.empty(rows, k, dtype=torch.int32, device=dev)
    local_w = torch.empty(rows, k, dtype=torch.float32, device=dev)
    row_valid = torch.empty(rows, dtype=torch.bool, device=dev)
    batched = cfg.layout == "batched"
    dest = torch.empty((rows, k) if batched else (0,), dtype=torch.int64, device=dev)
    counts = torch.empty(num_local if batched else 0, dtype=torch.int32, device=dev)
    try:
        torch.ops.ep_comm.collective_select_local(g.ids, g.weights, ctx.rank, num_local, capacity, local_ids,
                                                  local_w, row_valid, dest, counts)
    except RuntimeError as exc:  # a launch failure or arguments the op refuses: typed, with the cause
        raise EPError(f"collective selection kernel failed: {exc}") from exc
    if not batched:
        return Dispatched(layout="standard", x=g.x, x_scales=g.x_scales, topk_ids=local_ids, topk_weights=local_w,
                          num_tokens=num_tokens, epoch=epoch, handle=GatherHandle(g.rows, row_valid, None, local_w))
    tail = tuple(g.x.shape[1:])
    x_out = _scatter(g.x, dest, num_local * capacity)
    s_out = None if g.x_scales is None else _scatter(g.x_scales, dest, num_local * capacity)
    return Dispatched(
        layout="batched", x=x_out.view(num_local, capacity, *tail),
        x_scales=None if s_out is None else s_out.view(num_local, capacity, -1),
        expert_num_tokens=counts, num_tokens=num_tokens, epoch=epoch,
        handle=GatherHandle(g.rows, row_valid, dest, local_w),
    )


def _scatter(rows: torch.Tensor, dest: torch.Tensor, slots: int) -> torch.Tensor:
    """``[slots, *tail]`` of ``rows``' dtype: row r copied into every slot ``dest[r]`` names (others unset)."""
    out = torch.empty((slots, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    if rows.shape[0] and slots and out.numel():
        width = out.numel() // slots * out.element_size()
        src = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], width)
        try:
            torch.ops.ep_comm.collective_scatter_rows(src, dest, out.view(torch.uint8).reshape(slots, width))
        except RuntimeError as exc:
            raise EPError(f"collective row scatter kernel failed: {exc}") from exc
    return out
