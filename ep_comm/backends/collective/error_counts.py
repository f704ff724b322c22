"""Problems the collective family counts on the device without a host sync (CUDA-graph replays, and
ids dropped with validation off), raised by ``check_errors``."""
from __future__ import annotations

import torch

from ...config import EPConfig
from ...errors import EPError, EPInputError


class ErrorCounts:
    """int64 counters on the communicator's device."""

    INVALID_IDS = 0  # out-of-range expert ids treated as -1
    EPOCH_MISMATCH = 1  # a peer's data carried another (op, epoch) than ours
    TOKEN_OVERFLOW = 2  # a peer claimed more tokens than max_tokens_per_rank
    SIZE = 4

    def __init__(self, device: torch.device):
        self.counts = torch.zeros(self.SIZE, dtype=torch.int64, device=device)

    def add(self, which: int, count: torch.Tensor) -> None:
        """Add a 0-d device count (no synchronisation; legal while capturing)."""
        self.counts[which] += count

    def raise_counted(self, cfg: EPConfig) -> None:
        """Synchronise, reset the counters, and raise what they held (a peer on another call first)."""
        counts = self.counts.tolist()
        self.counts.zero_()
        if counts[self.EPOCH_MISMATCH]:
            raise EPError(f"{counts[self.EPOCH_MISMATCH]} peer message(s) carried another call's epoch: "
                          "ranks replayed different dispatch/combine calls")
        if counts[self.TOKEN_OVERFLOW]:
            raise EPError(f"{counts[self.TOKEN_OVERFLOW]} peer(s) sent more than max_tokens_per_rank="
                          f"{cfg.max_tokens_per_rank} tokens")
        if counts[self.INVALID_IDS]:
            raise EPInputError(f"{counts[self.INVALID_IDS]} topk_ids outside [-1, num_experts={cfg.num_experts}) "
                               "were treated as -1 (graph replays, or validate_ids=False)")
