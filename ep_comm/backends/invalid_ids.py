"""The collective backends' eager id check (``validate_ids``): each rank's count of out-of-range ids
travels in its packed buffer's header, so every rank learns every rank's count from the gathered data."""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import EPError
from ..routing import drop_invalid_ids
from .gathered import HEADER_INVALID_IDS


class InvalidIdReport:
    """``validate_ids`` on the collective backends' eager path, one per communicator.

    The caller's out-of-range ids are sent as -1 and counted on the device (``drop``); the count rides
    in the packed buffer's header (``HEADER_INVALID_IDS``), so after the gather every rank holds every
    rank's count without another exchange.  ``collect`` copies them to a pinned buffer kept for every
    call and ``invalid_ranks`` reads them once the whole dispatch is queued: the host waits for the
    device at the end of the call, never in the middle of it with the device idle (docs/design.md §10).
    """

    def __init__(self, world: int, num_experts: int, device: torch.device):
        self.num_experts = num_experts
        cuda = device.type == "cuda"
        self._host = torch.empty(world, dtype=torch.int32, pin_memory=True) if cuda else None
        self._copied = torch.cuda.Event() if cuda else None
        self._counts: Optional[torch.Tensor] = None
        self._pending = False  # a copy whose answer was never read (the call failed in between)

    def drop(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, count)``: ``topk_ids`` with out-of-range ids as -1, and a 0-d device count of them for
        ``pack``'s header.  No host synchronisation."""
        if self._pending:  # the pinned buffer is reused: an earlier copy must land before it is overwritten
            self._copied.synchronize()
            self._pending = False
        self._counts = None
        return drop_invalid_ids(topk_ids, self.num_experts)

    def collect(self, headers: torch.Tensor) -> None:
        """Queue the copy of every rank's count (``headers [world, HEADER_INTS]`` of the gathered buffers)."""
        counts = headers[:, HEADER_INVALID_IDS]
        if self._host is None:
            self._counts = counts.clone()
            return
        self._host.copy_(counts, non_blocking=True)
        self._copied.record()
        self._counts, self._pending = self._host, True

    def invalid_ranks(self) -> list[int]:
        """Ranks that sent out-of-range ids in this call (waits for the device to reach the copy)."""
        if self._counts is None:
            raise EPError("invalid_ranks() before the gathered counts were collected")
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        return [r for r, n in enumerate(self._counts.tolist()) if n]
