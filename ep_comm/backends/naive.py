"""``naive``: padded all_gather for dispatch, full all_reduce for combine.

The simplest correct transport: every rank receives every rank's ``max_tokens_per_rank`` slots, and
combine all-reduces every rank's float32 partial outputs for all tokens.  Static sizes make it
CUDA-graph capturable on NCCL; it works unchanged on gloo (CPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.control import OP_COMBINE, OP_DISPATCH
from ..layouts import Dispatched
from . import gathered as gd
from .base import RoutedBatch
from .collectives import all_gather_equal


class NaiveBackend(gd.CollectiveBackend):
    name = "naive"

    def dispatch(self, batch: RoutedBatch) -> Dispatched:
        ctx = self.ctx
        lay = gd.layout_for(batch, ctx.cfg.max_tokens_per_rank)
        send = torch.empty(lay.nbytes, dtype=torch.uint8, device=ctx.device)
        gd.pack(batch, lay, OP_DISPATCH, ctx.rank, send)
        recv = all_gather_equal(send, ctx.world_size, ctx.group)
        g = gd.unpack(list(recv.unbind(0)), [lay] * ctx.world_size)
        gd.check_dispatch_headers(ctx, g, OP_DISPATCH, batch.epoch)
        return gd.select_local(ctx, g, batch.num_tokens, batch.epoch)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        handle: gd.GatherHandle = dispatched.handle
        partial = gd.combine_partial(ctx, expert_out, handle)
        buf, chunk_rows = gd.add_combine_headers(ctx, partial, handle.rows, OP_COMBINE, dispatched.epoch)
        dist.all_reduce(buf, group=ctx.group)
        start = sum(chunk_rows[: ctx.rank])
        mine = gd.check_combine_header(ctx, buf[start: start + chunk_rows[ctx.rank]], OP_COMBINE, dispatched.epoch)
        out.copy_(mine[: dispatched.num_tokens])
        return out
