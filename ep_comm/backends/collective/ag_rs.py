"""``ag_rs``: all_gatherv for dispatch, reduce_scatterv for combine.

Unlike ``naive`` it moves only live tokens: in eager mode the control plane already told every rank
each peer's T, so the gather carries ``Σ T_r`` rows instead of ``world × max_tokens_per_rank`` and each
rank receives only its own tokens' reduced outputs.  While a CUDA graph is being captured sizes must
be static, so it pads to ``max_tokens_per_rank`` there (same collectives, fixed counts).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from .collectives import all_gather_equal, all_gatherv, reduce_scatterv
from .flow import CollectiveBackend
from .packing import RoutedBatch


class AllGatherReduceScatterBackend(CollectiveBackend):
    name = "ag_rs"

    def rows_per_rank(self, batch: RoutedBatch) -> list[int]:
        if batch.peer_tokens is not None:
            return list(batch.peer_tokens)
        return [self.ctx.cfg.max_tokens_per_rank] * self.ctx.group_size

    def own_rows(self, batch: RoutedBatch, eager: bool) -> int:
        return batch.num_tokens if eager else self.ctx.cfg.max_tokens_per_rank

    def gather(self, send: torch.Tensor, nbytes: list[int]) -> Union[torch.Tensor, Sequence[torch.Tensor]]:
        ctx = self.ctx
        if len(set(nbytes)) == 1:  # one [world, nbytes] tensor: unpack then reads strided views of it
            return all_gather_equal(send, ctx.group_size, ctx.group)
        return all_gatherv(send, nbytes, ctx.group_rank, ctx.group)

    def reduce(self, buf: torch.Tensor, chunk_rows: list[int]) -> torch.Tensor:
        ctx = self.ctx
        return reduce_scatterv(buf, chunk_rows, ctx.group_rank, ctx.group)
