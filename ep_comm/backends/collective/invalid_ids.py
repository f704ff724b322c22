"""Out-of-range expert ids on the collective family's dispatch: the one place that handles them.

An id outside ``[-1, num_experts)`` is never sent: it goes as -1.  What differs is how the ranks learn
of it, which depends on the call:

* **eager, ``validate_ids``** (the default): this rank's count rides in its packed buffer's header
  (``packing.HEADER_INVALID_IDS``), so after the all-gather every rank holds every rank's count
  without another exchange; the host reads them once the whole dispatch is queued (it waits for the
  device at the end of the call, never in the middle with the device idle) and every rank raises.
* **eager, validation off**: counted on the device and copied to the host asynchronously; a later
  call raises once the copy has landed, and ``check_errors`` raises it in any case.
* **CUDA-graph capture**: duplicates are merged and invalid ids dropped on the sender
  (``routing.sanitize_routing``), counted on the device, raised by ``check_errors``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...config import EPConfig
from ...errors import EPError, EPInputError
from ...routing import check_ids, drop_invalid_ids, sanitize_routing
from .error_counts import ErrorCounts
from .packing import HEADER_INVALID_IDS


class _PinnedCopy:
    """A pinned host tensor that device values are copied into without a sync, the event recorded behind
    the copy, and whether a copy is queued whose answer was not read yet (CUDA only)."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.copied = torch.cuda.Event()
        self.pending = False

    def start(self, src: torch.Tensor) -> None:
        self.host.copy_(src, non_blocking=True)
        self.copied.record()
        self.pending = True

    def wait(self) -> None:
        """Block until a pending copy has landed."""
        if self.pending:
            self.copied.synchronize()
            self.pending = False


class InvalidIds:
    """One per communicator of the collective family."""

    def __init__(self, cfg: EPConfig, rank: int, world: int, device: torch.device, counts: ErrorCounts,
                 labels: Optional[Sequence[int]] = None):
        """``rank``/``world``: group rank and size (the gathered order); ``labels``: the communicator rank
        of each group rank, what errors name (default: the same)."""
        self.cfg, self.rank, self.counts = cfg, rank, counts
        self.labels = list(labels) if labels is not None else list(range(world))
        cuda = device.type == "cuda"
        # eager validate_ids: every rank's count, copied into a pinned buffer kept for every call; pending
        # also covers a copy whose answer was never read (the call failed in between)
        self._headers = _PinnedCopy(torch.empty(world, dtype=torch.int32, pin_memory=True)) if cuda else None
        self._counts: Optional[torch.Tensor] = None
        # validation off: this rank's running count on its way to the host
        self._dropped = _PinnedCopy(torch.zeros(1, dtype=torch.int64, pin_memory=True)) if cuda else None

    # -- before the call ------------------------------------------------------------------------------
    def raise_earlier(self) -> None:
        """Validation off: raise for ids dropped by earlier calls, as far as the host can see without a sync."""
        if self._dropped is None:
            count = int(self.counts.counts[ErrorCounts.INVALID_IDS])
        elif self._dropped.pending and self._dropped.copied.query():
            self._dropped.pending, count = False, int(self._dropped.host[0])
        else:
            return
        if count:  # take off what is reported here; counts made since (graph replays too) stay
            self.counts.counts[ErrorCounts.INVALID_IDS] -= count
            if self._dropped is not None:
                self._dropped.host.zero_()
            raise EPInputError(f"{count} topk_ids outside [-1, num_experts={self.cfg.num_experts}) were sent as -1 "
                               "by earlier dispatch call(s) (validate_ids=False)")

    # -- the call -------------------------------------------------------------------------------------
    def route(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, capturing: bool,
              validate: bool) -> tuple[torch.Tensor, torch.Tensor, bool, Optional[torch.Tensor]]:
        """``(ids, weights, merged, header_count)``: what this rank sends, whether duplicates are merged
        already (else the receivers merge them), and the 0-d device count for the packed header (eager
        ``validate``, else None).  No host synchronisation."""
        num_experts = self.cfg.num_experts
        if capturing:
            ids, weights, invalid = sanitize_routing(topk_ids, topk_weights, num_experts)
            self.counts.add(ErrorCounts.INVALID_IDS, invalid)
            return ids, weights, True, None
        if validate:
            if self._headers is not None:  # the pinned buffer is reused: an earlier copy must land first
                self._headers.wait()
            self._counts = None
            ids, invalid = drop_invalid_ids(topk_ids, num_experts)
            return ids, topk_weights, False, invalid
        ids, invalid = drop_invalid_ids(topk_ids, num_experts)
        self.counts.add(ErrorCounts.INVALID_IDS, invalid)
        if self._dropped is not None:
            self._dropped.start(self.counts.counts[ErrorCounts.INVALID_IDS:ErrorCounts.INVALID_IDS + 1])
        return ids, topk_weights, False, None

    def collect(self, headers: torch.Tensor) -> None:
        """Queue the copy of every rank's count (``headers [world, HEADER_INTS]`` of the gathered buffers)."""
        counts = headers[:, HEADER_INVALID_IDS]
        if self._headers is None:
            self._counts = counts.clone()
            return
        self._headers.start(counts)
        self._counts = self._headers.host

    # -- after the call -------------------------------------------------------------------------------
    def raise_if_any(self, topk_ids: torch.Tensor) -> None:
        """Eager ``validate_ids``: raise on every rank if any rank sent invalid ids in this call (every
        rank holds the same counts); the offending rank's error names the first bad token."""
        if self._counts is None:
            raise EPError("the gathered invalid-id counts were not collected")
        if self._headers is not None:
            self._headers.wait()
        bad = [r for r, n in enumerate(self._counts.tolist()) if n]
        if not bad:
            return
        me = self.labels[self.rank]
        if self.rank in bad:
            check_ids(topk_ids, self.cfg.num_experts, me)  # raises, naming the token
            raise EPInputError(f"rank {me}: topk_ids outside [-1, num_experts={self.cfg.num_experts})")
        named = [self.labels[r] for r in bad]
        raise EPInputError(f"invalid input on peer rank(s) {named} (topk_ids outside [-1, num_experts="
                           f"{self.cfg.num_experts}); the dispatch is not returned on any rank)")

    def reset(self) -> None:
        """After ``check_errors`` read and zeroed the counters (a sync: no copy is in flight)."""
        if self._dropped is not None:
            self._dropped.host.zero_()
            self._dropped.pending = False
