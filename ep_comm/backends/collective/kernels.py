"""The collective family's CUDA kernels (csrc/collective/): layout selection and the batched combine.

``ep_comm::collective_select_local`` and ``ep_comm::collective_scatter_rows`` turn the all-gathered
token table into this rank's ``Dispatched`` in two launches (standard layout) or three (batched: local
ids and weights, slots per expert, rows copied into their slots), where the torch ops of
``selection.select_local`` take a dozen (standard) to a few dozen (batched) small launches, each
costing host time.  ``ep_comm::collective_combine_partial`` computes the batched combine's partial
sums in one pass.  Same results as the torch ops, which stay for CPUs and for builds without the
extension (tests/backends/collective/test_kernels.py compares the two).
"""
from __future__ import annotations

import functools
import os

import torch

from ...errors import EPError
from ...layouts import Dispatched
from .. import extension
from ..base import BackendContext
from .packing import Gathered, GatherHandle

SELECT_ENV = "EP_COMM_COLLECTIVE_SELECT"  # "torch": select with torch ops even where the kernels are built
COMBINE_ENV = "EP_COMM_COLLECTIVE_COMBINE"  # "torch": the batched combine's partials with torch ops


@functools.cache
def _op_unavailable(op: str, env: str) -> str:
    """'' when ``ep_comm::<op>`` can run on CUDA, else why torch ops run instead (read once)."""
    if os.environ.get(env, "").lower() == "torch":
        return f"{env}=torch"
    why = extension.unavailable_reason()
    if why:
        return why
    if not hasattr(torch.ops.ep_comm, op):
        return f"the installed ep_comm._C has no ep_comm::{op}: reinstall the package"
    _register_fakes()
    return ""


def select_unavailable() -> str:
    """'' when selection on CUDA runs the kernels, else why it runs torch ops."""
    return _op_unavailable("collective_select_local", SELECT_ENV)


def combine_unavailable() -> str:
    """'' when the batched combine on CUDA runs the fused kernel, else why it runs torch ops."""
    return _op_unavailable("collective_combine_partial", COMBINE_ENV)


def select(ctx: BackendContext, g: Gathered, num_tokens: int, epoch: int) -> Dispatched:
    """``selection.select_local`` on CUDA in kernels (duplicates always merged: on ids the sender
    already merged that changes nothing).  ``g`` holds int32 ids / float32 weights."""
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


def combine_partial(flat: torch.Tensor, handle: GatherHandle, out: torch.Tensor) -> None:
    """One kernel: per gathered row, read only the local pairs' rows, weight and sum them in float32
    and write the row once (padding never read, rows without a local pair written as zeros)."""
    why = combine_unavailable()
    if why:
        raise EPError(f"the fused collective combine kernel cannot run: {why}")
    # checked here too, not only by the op: a TORCH_CHECK refusal inside the op has taken a pytest
    # process down with it on a GPU machine, so the refusal must not depend on the op
    dest = handle.dest
    if dest is None:  # a standard-layout handle: its rows are combined without the kernel
        raise EPError("collective combine kernel cannot run: dest must be int64 [rows, k], got None (the "
                      "standard layout's handle)")
    if dest.dtype != torch.int64 or dest.dim() != 2:
        raise EPError(f"collective combine kernel cannot run: dest must be int64 [rows, k], got "
                      f"{dest.dtype} {tuple(dest.shape)}")
    if out.shape[-1] != flat.shape[-1]:
        raise EPError(f"collective combine kernel cannot run: out has width {out.shape[-1]}, expert_out "
                      f"{flat.shape[-1]}")
    try:
        torch.ops.ep_comm.collective_combine_partial(flat, dest, handle.local_weights, out)
    except RuntimeError as exc:  # a launch failure or a shape the op refuses: typed, with the cause
        raise EPError(f"collective combine kernel failed: {exc}") from exc


@functools.cache
def _register_fakes() -> None:
    """Fake implementations for torch.compile (the ops write into their arguments and return nothing)."""
    lib = "ep_comm::"

    @torch.library.register_fake(lib + "collective_combine_partial")
    def _combine_partial_fake(expert_out, dest, weights, out):
        return None

    @torch.library.register_fake(lib + "collective_select_local")
    def _select_local_fake(ids, weights, rank, num_local, capacity, local_ids, local_w, row_valid, dest, counts):
        return None

    @torch.library.register_fake(lib + "collective_scatter_rows")
    def _scatter_rows_fake(src, dest, out):
        return None
