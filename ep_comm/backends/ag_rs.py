"""``ag_rs``: all_gatherv for dispatch, reduce_scatterv for combine.

Unlike ``naive`` it moves only live tokens: in eager mode the control plane already told every rank
each peer's T, so the gather carries ``Σ T_r`` rows instead of ``world × max_tokens_per_rank`` and each
rank receives only its own tokens' reduced outputs.  While a CUDA graph is being captured sizes must
be static, so it pads to ``max_tokens_per_rank`` there (same collectives, fixed counts).
"""
from __future__ import annotations

import torch

from ..distributed.control import OP_COMBINE, OP_DISPATCH
from ..layouts import Dispatched
from . import gathered as gd
from .base import RoutedBatch
from .collectives import all_gatherv, reduce_scatterv


class AllGatherReduceScatterBackend(gd.CollectiveBackend):
    name = "ag_rs"

    def dispatch(self, batch: RoutedBatch) -> Dispatched:
        ctx = self.ctx
        rows = list(batch.peer_tokens) if batch.peer_tokens is not None else [ctx.cfg.max_tokens_per_rank] * ctx.world_size
        layouts = [gd.layout_for(batch, n) for n in rows]
        send = torch.empty(layouts[ctx.rank].nbytes, dtype=torch.uint8, device=ctx.device)
        gd.pack(batch, layouts[ctx.rank], OP_DISPATCH, ctx.rank, send)
        bufs = all_gatherv(send, [lay.nbytes for lay in layouts], ctx.rank, ctx.control.global_ranks, ctx.group)
        g = gd.unpack(bufs, layouts)
        gd.check_dispatch_headers(ctx, g, OP_DISPATCH, batch.epoch)
        return gd.select_local(ctx, g, batch.num_tokens, batch.epoch)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, out: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        handle: gd.GatherHandle = dispatched.handle
        partial = gd.combine_partial(ctx, expert_out, handle)
        buf, chunk_rows = gd.add_combine_headers(ctx, partial, handle.rows, OP_COMBINE, dispatched.epoch)
        mine = reduce_scatterv(buf, chunk_rows, ctx.rank, ctx.control.global_ranks, ctx.group)
        mine = gd.check_combine_header(ctx, mine, OP_COMBINE, dispatched.epoch)
        out.copy_(mine[: dispatched.num_tokens])
        return out
