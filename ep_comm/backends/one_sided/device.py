"""One communicator's one-sided kernels: the device state they share, their launches, and the words
through which the device reports problems to the host.

``OneSidedBackend`` (the host protocol) talks to the GPU only through ``Kernels``, so that protocol
is checked on CPUs against a stand-in (tests/backends/one_sided/test_call_protocol.py).
"""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from ...config import EPConfig
from ...memory import _driver
from ..base import BackendContext
from ..protocol import Cfg, Pending, State, Trace, latest_code
from .errors import StatusReport, status_words
from .layout import BufferLayout, config_vector
from .ops import KernelOps, MappedWords

TRACE_ENV = "EP_COMM_TRACE"  # "1": the kernels stamp their phases (a diagnostic; costs block barriers)
VERDICT_POLL_S = 2e-3  # how long the host polls for the input verdict before it blocks
VERDICT_ROWS = 2  # flag rows 2 + parity of the flags region hold the input verdicts (kernel_common.cuh)

#: the raw outputs of a dispatch launch: out_x, out_scales, row_ids, row_w, row_slot, counts, dest
DispatchOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor]


def state_numel(world: int) -> int:
    """int64 elements of the state tensor: the counters, then the int32 error record, rounded up."""
    return State.COUNTERS + (status_words(world) + 1) // 2


def expert_owner_table(num_experts: int, world: int, expert_active: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 ``[num_experts]``: owner rank << 16 | local index, the device table the kernels look an
    expert up in (contiguous blocks today; redundant placement needs only another table); -1 where
    ``expert_active`` (bool ``[num_experts]``) is False: after a shrink those pairs are dropped."""
    per_rank = num_experts // world
    ids = torch.arange(num_experts, dtype=torch.int32)
    table = (ids // per_rank) * 65536 + ids % per_rank
    if expert_active is not None:
        table = torch.where(expert_active.cpu(), table, torch.full_like(table, -1))
    return table


def _spins_for_the_host(device_index: int) -> bool:
    """Whether the host may busy-wait for the id check: not where the process asked CUDA to yield or
    block while waiting (then it waits the way it asked), nor where the driver cannot say."""
    try:
        return not _driver.host_waits_yield(device_index)
    except Exception:  # noqa: BLE001 - the synchronising wait is always right, only slower
        return False


class Kernels:
    """The device side of one one-sided communicator."""

    def __init__(self, ctx: BackendContext, local: torch.Tensor, peer_base: torch.Tensor, layout: BufferLayout,
                 num_blocks: int, ops: KernelOps, first_call: int = 0):
        """``first_call``: the kernel call number to start from (after a shrink, one above every call
        any survivor made, so no flag written before it is taken for a new one)."""
        cfg: EPConfig = ctx.cfg
        dev = ctx.device
        self.device, self.world, self.num_blocks, self.ops = dev, ctx.world_size, num_blocks, ops
        self.local, self.peer_base, self.flags_offset = local, peer_base, layout.flags_offset
        self.state = torch.zeros(state_numel(ctx.world_size), dtype=torch.int64, device=dev)
        self.state[State.SEQ] = first_call
        self.work = torch.zeros(layout.work_numel(ctx.num_local_experts), dtype=torch.int32, device=dev)
        full = ctx.is_full
        self.expert_owner = expert_owner_table(cfg.num_experts, ctx.world_size,
                                               None if full else ctx.expert_active).to(dev)
        self._mapped = MappedWords()
        self.words = self._mapped.words
        self.cfg = config_vector(cfg, ctx.rank, ctx.world_size, layout, num_blocks, self._mapped.device_ptr)
        self.active: Optional[torch.Tensor] = None  # after a shrink: int32 [world], 1 for the ranks still in
        if not full:
            self.active = torch.zeros(ctx.world_size, dtype=torch.int32)
            self.active[list(ctx.active_ranks)] = 1
            self.active = self.active.to(dev)
            self.cfg[Cfg.ACTIVE_PTR] = self.active.data_ptr()
        self._verdict_done = torch.cuda.Event()  # recorded after the last queued input verdict
        self._refusal_running = False  # the last verdict was a refusal's, not waited for by this host
        self._verdict_wait_spin = _spins_for_the_host(dev.index)
        # phase stamps for bench/kernel_trace.py: [2 ops][num_blocks][Trace.SLOTS] globaltimer ns
        self.trace: Optional[torch.Tensor] = None
        if os.environ.get(TRACE_ENV) == "1":
            self.trace = torch.zeros(2 * num_blocks * Trace.SLOTS, dtype=torch.int64, device=dev)
            self.cfg[Cfg.TRACE_PTR] = self.trace.data_ptr()

    @property
    def zero_copy(self) -> bool:
        return bool(self.cfg[Cfg.ZERO_COPY])

    def read_expert_rows_from(self, rows: torch.Tensor) -> None:
        """Combine pulls: peers read this rank's expert outputs in place at ``rows`` (in the buffer)."""
        self.cfg[Cfg.COMBINE_PULL_INPUT] = rows.data_ptr()

    # -- launches -------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor], phases: int) -> DispatchOutputs:
        return self.ops.dispatch(x, topk_ids, topk_weights, x_scales, self.state, self.work, self.peer_base,
                                 self.expert_owner, self.cfg, phases)

    def dispatch_recv(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], outputs: tuple) -> None:
        """The receive half of a dispatch launched with ``Phase.SEND``; fills ``outputs`` (its first six)."""
        self.ops.dispatch_recv(x, x_scales, self.state, self.work, self.peer_base, *outputs, self.cfg)

    def combine(self, expert_out: torch.Tensor, row_ids: torch.Tensor, row_w: torch.Tensor, row_slot: torch.Tensor,
                dest: torch.Tensor, out: torch.Tensor, phases: int) -> None:
        self.ops.combine(expert_out, row_ids, row_w, row_slot, dest, self.state, self.peer_base, out, self.cfg, phases)

    def abort(self, calls: int) -> None:
        """Signal every peer that this rank gives up ``calls`` call numbers from the current one: 1, a
        combine; 2, a dispatch and the combine that would have followed it."""
        self.ops.abort(self.state, self.peer_base, self.cfg, calls)

    # -- the input verdict (eager calls with validate_ids) ---------------------------------------------
    def start_verdict(self, topk_ids: torch.Tensor) -> None:
        """Queue the input verdict in front of a dispatch launched with ``Phase.CHECKED``: this rank's
        ids range-checked and every rank's verdict exchanged on the device, then an event.  The dispatch
        is launched behind it and the host waits on the event afterwards (``wait_verdict``), so the GPU
        never idles while the host decides, and every rank learns in this call whether it runs."""
        # the words belong to the verdict queued last: a refusal's (never waited for) may still be
        # running and would set them after this reset; any other was waited for by wait_verdict
        if self._refusal_running:
            self._verdict_done.synchronize()
            self._refusal_running = False
        self.words[Pending.IDS_CHECK] = self.words[Pending.VERDICT] = 0
        self.ops.verdict(topk_ids, 0, False, self.state, self.peer_base, self.cfg)
        self._verdict_done.record(torch.cuda.current_stream(self.device))

    def refuse(self) -> None:
        """This rank's dispatch input failed the host's checks: give the peers a bad verdict for this
        call (their dispatch kernels skip it) and take the call number, launching no dispatch."""
        self.ops.verdict(None, 1, True, self.state, self.peer_base, self.cfg)
        self._verdict_done.record(torch.cuda.current_stream(self.device))
        self._refusal_running = True

    def wait_verdict(self) -> tuple[bool, bool]:
        """``(own_ids_bad, skipped)`` of the verdict queued last: one device-to-host synchronisation,
        with the verdict kernel, not with the dispatch behind it."""
        done = False
        if self._verdict_wait_spin:
            # polled, not cudaEventSynchronize: the host gets back to the stream sooner, and that is on
            # the eager dispatch's critical path.  Bounded, as query() keeps the GIL: a host far ahead
            # of its stream then blocks (releasing it) rather than holding other Python threads off.
            give_up = time.perf_counter() + VERDICT_POLL_S
            while not (done := self._verdict_done.query()) and time.perf_counter() < give_up:
                pass
        if not done:
            self._verdict_done.synchronize()
        return bool(self.words[Pending.IDS_CHECK]), bool(self.words[Pending.VERDICT])

    def bad_verdicts(self, rank: int) -> tuple[int, dict[int, int]]:
        """After a skipped call: its flag code and the ranks whose verdict was bad, with their verdict
        bits (1: input the host refused, 2: ids out of range).  Synchronises (the error path only).
        The call is the one of ``rank``'s (this rank's) own latest verdict: a fast peer may already
        have written its verdict for the next call into the other parity."""
        off, world = self.flags_offset, self.world
        rows = self.local[off: off + 4 * world * 8].view(torch.int64).view(4, world)[VERDICT_ROWS:].tolist()
        codes = [[v & 0xFFFFFFFF for v in row] for row in rows]
        code = latest_code(codes[0][rank], codes[1][rank])
        bad = {}
        for r in range(world):
            for parity in (0, 1):
                if codes[parity][r] == code and (rows[parity][r] >> 32):
                    bad[r] = rows[parity][r] >> 32
        return code, bad

    # -- what the device reported ---------------------------------------------------------------------
    def fatal_pending(self) -> bool:
        """The error record holds a problem that breaks the call sequence (no synchronisation)."""
        return bool(self.words[Pending.FATAL])

    def recoverable_pending(self) -> bool:
        """An earlier call dropped out-of-range ids (validation off), without synchronising."""
        return bool(self.words[Pending.RECOVERABLE])

    def take_record(self) -> StatusReport:
        """Synchronise, read the error record, and clear it and the pending words."""
        torch.cuda.synchronize(self.device)
        words = self.state[State.COUNTERS:].view(torch.int32)
        report = StatusReport.from_words(words.tolist(), self.world)
        self.words[Pending.FATAL] = self.words[Pending.RECOVERABLE] = 0
        if not report.empty:
            words.zero_()
        return report

    def calls_made(self) -> int:
        """The kernel call number the next call would take (synchronises)."""
        return int(self.state[State.SEQ].item())

    def flag_slots(self) -> list[list[int]]:
        """``[2][world]``: the flag words the peers last wrote into this rank's buffer (per parity)."""
        off, world = self.flags_offset, self.world
        return self.local[off: off + 2 * world * 8].view(torch.int64).view(2, world).tolist()

    def release(self) -> None:
        self._mapped.release()
