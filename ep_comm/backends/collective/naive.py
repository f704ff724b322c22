"""``naive``: padded all_gather for dispatch, full all_reduce for combine.

The simplest correct transport: every rank receives every rank's ``max_tokens_per_rank`` slots, and
combine all-reduces every rank's float32 partial outputs for all tokens.  Static sizes make it
CUDA-graph capturable on NCCL; it works unchanged on gloo (CPU).
"""
from __future__ import annotations

import torch

from .collectives import all_gather_equal, all_reduce
from .flow import CollectiveBackend
from .packing import RoutedBatch


class NaiveBackend(CollectiveBackend):
    name = "naive"

    def rows_per_rank(self, batch: RoutedBatch) -> list[int]:
        return [self.ctx.cfg.max_tokens_per_rank] * self.ctx.group_size

    def own_rows(self, batch: RoutedBatch, eager: bool) -> int:
        return self.ctx.cfg.max_tokens_per_rank

    def gather(self, send: torch.Tensor, nbytes: list[int]) -> torch.Tensor:
        return all_gather_equal(send, self.ctx.group_size, self.ctx.group)

    def reduce(self, buf: torch.Tensor, chunk_rows: list[int]) -> torch.Tensor:
        all_reduce(buf, self.ctx.group)
        me = self.ctx.group_rank
        start = sum(chunk_rows[:me])
        return buf[start: start + chunk_rows[me]]
