"""The one-sided kernels' error record, decoded into the typed error a rank raises.

The kernels never trap: a wait that gives up, a peer on another call, a peer that abandoned the call
or sent rows of another width, all land in an int32 record in device memory (``protocol.Status``)
and raise a host-mapped word (``protocol.Pending``).  The host reads the record after a
synchronisation and turns it into one ``EPError`` here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ...errors import EPError, EPInputError, EPTimeoutError
from ..protocol import Op, Reason, Status, describe_code, latest_code


def status_words(world: int) -> int:
    """int32 words of the error record."""
    return Status.RANK_REASON + 2 * world


@dataclasses.dataclass(frozen=True)
class StatusReport:
    """The device error record, decoded (read after a synchronisation)."""

    invalid_ids: int
    timeouts: int
    overflow: int
    local_stall: int
    row_format: int
    expected_code: int
    reasons: tuple[int, ...]  # per rank: Reason bits
    seen: tuple[int, ...]  # per rank: the flag code seen when it was flagged

    @classmethod
    def from_words(cls, words: list[int], world: int) -> StatusReport:
        base = Status.RANK_REASON
        return cls(words[Status.INVALID_IDS], words[Status.TIMEOUTS], words[Status.OVERFLOW],
                   words[Status.LOCAL_STALL], words[Status.ROW_FORMAT], words[Status.EXPECTED_CODE] & 0xFFFFFFFF,
                   tuple(words[base: base + world]),
                   tuple(w & 0xFFFFFFFF for w in words[base + world: base + 2 * world]))

    def ranks_with(self, reason: int) -> list[int]:
        return [r for r, bits in enumerate(self.reasons) if bits & reason]

    @property
    def empty(self) -> bool:
        return not (self.invalid_ids or self.timeouts or self.overflow or self.local_stall or self.row_format
                    or any(self.reasons))


def last_signalled(report: StatusReport, flag_slots: list[list[int]]) -> list[int]:
    """Per rank, the latest call code it wrote into this rank's flags (``flag_slots [2][world]``, either
    parity) or the one the kernel saw when it flagged the rank: the slot a wait read may hold a call
    from two calls ago, or nothing, when the peer stopped one call earlier."""
    # a format error records the peer's row width, not a code
    seen = [0 if bits & Reason.FORMAT else report.seen[r] for r, bits in enumerate(report.reasons)]
    return [latest_code(seen[r], flag_slots[0][r], flag_slots[1][r]) for r in range(len(seen))]


def error_from(report: StatusReport, last: list[int], rank: int, backend: str, timeout_s: float,
               num_sms: int, max_tokens: int, num_experts: int) -> tuple[EPError, bool]:
    """``(error, fatal)``: the error this rank raises for ``report``, and whether the ranks' call
    sequences can no longer be trusted (every later call must raise it too).  ``last``: see
    ``last_signalled``."""
    expected = describe_code(report.expected_code)

    def seen(ranks: list[int]) -> str:
        return "; ".join(f"rank {r} last signalled {describe_code(last[r])}" for r in ranks)

    error: Optional[EPError] = None
    # a peer that abandoned a call gave up the call numbers its peers made meanwhile: in step again
    only_aborts = not (report.local_stall or report.overflow or report.row_format
                       or report.ranks_with(Reason.TIMEOUT | Reason.MISMATCH | Reason.FORMAT))
    if report.local_stall:
        error = EPError(f"rank {rank}: {backend} kernel blocks were not all resident within timeout_s={timeout_s:g} "
                        f"(num_sms={num_sms} too large while other kernels hold the GPU?)")
    elif report.ranks_with(Reason.ABORT):
        aborted = report.ranks_with(Reason.ABORT)
        which = ("that dispatch and of the combine after it" if (report.expected_code & 3) == Op.DISPATCH
                 else "that combine")
        error = EPInputError(f"invalid input on peer rank(s) {aborted}: they abandoned {expected} (their own "
                             f"error says why); this rank's result of {which} lacks their part")
        if only_aborts:
            return error, False
    elif report.ranks_with(Reason.TIMEOUT):
        missing, waiting = behind_and_in_step(report.ranks_with(Reason.TIMEOUT), last, report.expected_code)
        also = (f"; rank(s) {waiting} reached {expected} too but had not finished it when this rank gave up "
                "(they wait on the same missing rank(s))") if waiting else ""
        error = EPTimeoutError(
            f"rank {rank}: {backend} {expected} did not complete within timeout_s={timeout_s:g}: no signal from "
            f"rank(s) {missing} ({seen(missing)}){also}", missing_ranks=missing)
    elif report.ranks_with(Reason.MISMATCH):
        error = EPError(f"rank {rank}: ranks are on different calls: this rank was in {expected}, "
                        f"{seen(report.ranks_with(Reason.MISMATCH))}; every rank must call dispatch/combine "
                        "in the same order")
    elif report.ranks_with(Reason.FORMAT):
        error = EPInputError(f"rank(s) {report.ranks_with(Reason.FORMAT)} sent rows of another payload/scale "
                             f"width than rank {rank} in the same call; every rank must pass x and x_scales "
                             "of the same width and dtype")
    elif report.overflow:
        error = EPError(f"rank {rank}: a peer announced more than max_tokens_per_rank={max_tokens} tokens")
    if error is not None:
        return error, True
    # ids were treated as -1 on every rank alike: the ranks are still in step
    return EPInputError(f"{report.invalid_ids} topk_ids outside [-1, num_experts={num_experts}) were treated as -1 "
                        "(id validation switched off, or a CUDA-graph replay)"), False


def behind_and_in_step(flagged: list[int], last: list[int], expected: int) -> tuple[list[int], list[int]]:
    """The ranks a wait gave up on, split into those that never reached the call and those that did.

    With three or more ranks one missing rank holds up the others too (a pulling combine releases its
    peers only after reading every rank's rows), so their late "done" flags get them recorded as well;
    naming them as missing would blame ranks that are in step.  When every flagged rank reached the
    call, they are all named: they are the ones stuck in it."""
    behind = [r for r in flagged if last[r] != expected]
    return (behind, [r for r in flagged if r not in behind]) if behind else (flagged, [])
