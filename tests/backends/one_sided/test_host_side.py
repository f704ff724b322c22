"""The one-sided family's host-side decisions on CPU (no kernels): which dispatch inputs are sent in
place, which are copied first, what a timeout message says a peer last signalled, and how the host
waits for the eager id check.  The buffer is a plain CPU tensor laid out as the GPU's would be."""
from __future__ import annotations

import types

import pytest
import torch

import ep_comm
from ep_comm.backends.one_sided import device, errors
from ep_comm.backends.one_sided.device import Kernels
from ep_comm.backends.one_sided.layout import BufferLayout
from ep_comm.backends.one_sided.mnnvl import MnnvlBackend
from ep_comm.backends.protocol import Pending, Reason, Status

WORLD, RANK = 2, 1


def _backend(zero_copy: bool = True, quant=None, world: int = WORLD, rank: int = RANK) -> MnnvlBackend:
    cfg = ep_comm.EPConfig(num_experts=4 * world, top_k=4, hidden=128, max_tokens_per_rank=8, zero_copy=zero_copy,
                           quant=quant, timeout_s=3.0)
    layout = BufferLayout.for_config(cfg, world)
    b = object.__new__(MnnvlBackend)  # the host-side state only: no device, no kernels
    b.ctx = types.SimpleNamespace(cfg=cfg, rank=rank, world_size=world)
    b._fatal = None
    b.buffer = types.SimpleNamespace(local=torch.zeros(layout.nbytes, dtype=torch.uint8))
    b.layout, b.zero_copy, b._views, b._input_rows = layout, zero_copy, {}, None
    return b


def test_the_input_buffer_is_this_ranks_own_rows_of_dispatch_half_0():
    b = _backend()
    lay, cfg = b.layout, b.ctx.cfg
    rows = b.dispatch_input_buffer()
    assert rows is b.dispatch_input_buffer()  # one view, every call
    assert tuple(rows.shape) == (cfg.max_tokens_per_rank, cfg.hidden) and rows.dtype == cfg.dtype
    assert rows.stride() == (lay.row_stride // cfg.dtype.itemsize, 1)
    own_first_row = lay.dispatch_offset[0] + RANK * cfg.max_tokens_per_rank * lay.row_stride
    assert rows.data_ptr() == b.buffer.local.data_ptr() + own_first_row + lay.meta_bytes
    assert _backend(quant="fp8").dispatch_input_buffer() is None  # the quantised rows would overwrite x
    assert _backend(zero_copy=False).dispatch_input_buffer() is None


def test_only_a_prefix_of_the_input_buffer_is_sent_in_place():
    b = _backend()
    rows = b.dispatch_input_buffer()
    rows.copy_(torch.randn(rows.shape).to(rows.dtype))
    for x in (rows, rows[:5], rows[:1], rows[:0]):
        assert b._apart_from_buffer(x) is x
    outside = torch.randn(5, rows.shape[1]).to(rows.dtype)
    assert b._apart_from_buffer(outside) is outside
    local = b.buffer.local
    peer_rows = b._rows_in_buffer(b.layout.meta_bytes, rows)[: rows.shape[0]]  # rank 0's rows, same buffer
    as_bytes = local[: 2 * rows.shape[1]].view(rows.dtype).view(2, -1)  # the flags region, another layout
    for x in (rows[1:6], rows[1:2], peer_rows[:3], as_bytes):
        y = b._apart_from_buffer(x)
        assert y is not x and y.is_contiguous() and torch.equal(y, x)  # copied out of the buffer first
        assert not local.data_ptr() <= y.data_ptr() < local.data_ptr() + local.numel()


def test_without_zero_copy_nothing_is_checked_or_copied():
    b = _backend(zero_copy=False)
    x = b.buffer.local[:512].view(torch.bfloat16).view(2, 128)  # (no view of the buffer is ever handed out)
    assert b._apart_from_buffer(x) is x


def _flag_slots(b: MnnvlBackend) -> torch.Tensor:
    """``[parity, rank]`` int64 view of the call-flag slots peers write into ``b``'s buffer."""
    world, off = b.ctx.world_size, b.layout.flags_offset
    return b.buffer.local[off: off + 2 * world * 8].view(torch.int64).view(2, world)


def test_a_timeout_names_the_latest_call_a_peer_signalled_in_either_flag_slot():
    b = _backend()
    slots = _flag_slots(b)
    dispatch5, combine6 = (5 << 2) | 1, (6 << 2) | 2
    slots[1, 0] = (128 << 32) | dispatch5  # the token count rides in the high word
    slots[0, 0] = combine6
    words = [0] * errors.status_words(WORLD)
    words[Status.RANK_REASON + 0] = Reason.TIMEOUT
    report = errors.StatusReport.from_words(words, WORLD)  # the kernel saw nothing in the slot it waited on
    assert errors.last_signalled(report, slots.tolist())[0] == combine6
    slots[0, 0] = 0
    assert errors.last_signalled(report, slots.tolist())[0] == dispatch5
    words[Status.RANK_REASON + 0] = Reason.FORMAT
    words[Status.RANK_REASON + WORLD + 0] = 7168 * 2  # a format error records a row width, not a code
    report = errors.StatusReport.from_words(words, WORLD)
    assert errors.last_signalled(report, slots.tolist())[0] == dispatch5


def _timeout_error(b: MnnvlBackend, expected: int, last: dict[int, int]) -> ep_comm.EPError:
    """The error for a timeout record of ``b``'s rank: every rank in ``last`` flagged, its flag slot
    holding that code."""
    world, slots = b.ctx.world_size, _flag_slots(b)
    words = [0] * errors.status_words(world)
    words[Status.EXPECTED_CODE] = expected
    for r, code in last.items():
        slots[0, r] = code
        words[Status.RANK_REASON + r] = Reason.TIMEOUT
    report = errors.StatusReport.from_words(words, world)
    cfg = b.ctx.cfg
    error, fatal = errors.error_from(report, errors.last_signalled(report, slots.tolist()), b.ctx.rank, "mnnvl",
                                     cfg.timeout_s, 24, cfg.max_tokens_per_rank, cfg.num_experts)
    assert fatal
    return error


def test_ranks_held_up_by_a_missing_rank_are_not_named_as_missing():
    """World 4, pulling combine #9, rank 3 never came: ranks 1 and 2 reached the combine but release rank
    0's rows only after reading rank 3's, so rank 0's wait records them too.  Only rank 3 is missing."""
    b = _backend(world=4, rank=0)
    dispatch8, combine9 = (8 << 2) | 1, (9 << 2) | 2
    err = _timeout_error(b, combine9, {1: combine9, 2: combine9, 3: dispatch8})
    assert isinstance(err, ep_comm.EPTimeoutError)
    assert list(err.missing_ranks) == [3], err
    assert "no signal from rank(s) [3] (rank 3 last signalled dispatch #8)" in str(err), err
    assert "rank(s) [1, 2] reached combine #9 too but had not finished it" in str(err), err


def test_ranks_stuck_inside_the_call_are_named_when_none_is_behind():
    b = _backend(world=4, rank=0)
    combine9 = (9 << 2) | 2
    err = _timeout_error(b, combine9, {2: combine9})
    assert list(err.missing_ranks) == [2], err
    assert "reached" not in str(err), err


class _CheckEvent:
    """Stands in for the event after the input verdict: done after ``pending`` queries."""

    def __init__(self, pending: int):
        self.pending, self.queries, self.synchronized = pending, 0, False

    def query(self) -> bool:
        self.queries += 1
        return self.queries > self.pending

    def synchronize(self) -> None:
        self.synchronized = True


def test_the_verdict_is_polled_unless_the_process_asked_cuda_to_yield(monkeypatch):
    import numpy as np

    def waited(spin: bool) -> tuple:
        k = object.__new__(Kernels)  # the host side only: no device
        k.words = np.zeros(Pending.WORDS, dtype=np.int32)
        k._verdict_wait_spin, k._verdict_done = spin, _CheckEvent(pending=3)
        assert k.wait_verdict() == (False, False)
        k.words[Pending.IDS_CHECK] = k.words[Pending.VERDICT] = 1  # this rank's ids were out of range
        assert k.wait_verdict() == (True, True)
        k.words[Pending.IDS_CHECK] = 0  # a peer's input was bad
        assert k.wait_verdict() == (False, True)
        return k._verdict_done.queries, k._verdict_done.synchronized

    assert waited(spin=True) == (6, False)  # 4 polls, then 1 for each later call (done by then)
    assert waited(spin=False) == (0, True)
    monkeypatch.setattr(device, "VERDICT_POLL_S", 0.0)  # still pending when the polling time is up: it blocks
    assert waited(spin=True) == (3, True)


def test_the_host_spins_only_where_cuda_would_spin(monkeypatch):
    from ep_comm.memory import _driver

    flags = {"value": 0}

    class CUresult(int):
        CUDA_SUCCESS = 0

    class Flags:  # the values of cuda.bindings.driver.CUctx_flags
        CU_CTX_SCHED_AUTO, CU_CTX_SCHED_SPIN, CU_CTX_SCHED_YIELD, CU_CTX_SCHED_BLOCKING_SYNC = 0, 1, 2, 4
        CU_CTX_SCHED_MASK = 7

    fake = types.SimpleNamespace(
        CUresult=CUresult, CUctx_flags=Flags, cuInit=lambda _f: (0,), cuDeviceGet=lambda i: (0, i),
        cuDevicePrimaryCtxGetState=lambda dev: (0, flags["value"] | 8, 1))  # 8: CU_CTX_MAP_HOST, not a sched bit
    monkeypatch.setattr(_driver, "_DRIVER", fake)
    for sched, spins in ((0, True), (1, True), (2, False), (4, False)):
        flags["value"] = sched
        assert device._spins_for_the_host(0) is spins
    monkeypatch.setattr(_driver, "_DRIVER", types.SimpleNamespace(
        **{**vars(fake), "cuDevicePrimaryCtxGetState": lambda dev: (201, 0, 0)}))
    monkeypatch.setattr(_driver, "error_name", lambda cu, err: "CUDA_ERROR_INVALID_CONTEXT")
    assert device._spins_for_the_host(0) is False  # the driver cannot say: the synchronising wait


class _TimedOutKernels:
    """The device side after a dispatch whose wait gave up on rank 1 (it never signalled)."""

    num_blocks = 24

    def __init__(self, world: int):
        self.world = world

    def take_record(self) -> errors.StatusReport:
        words = [0] * errors.status_words(self.world)
        words[Status.TIMEOUTS] = 1
        words[Status.EXPECTED_CODE] = (3 << 2) | 1
        words[Status.RANK_REASON + 1] = Reason.TIMEOUT
        return errors.StatusReport.from_words(words, self.world)

    def flag_slots(self) -> list[list[int]]:
        return [[0] * self.world, [0] * self.world]


def _timed_out_backend(gone: dict[int, str]) -> MnnvlBackend:
    b = _backend(world=2, rank=0)
    b.kernels = _TimedOutKernels(2)
    b.ctx.control = types.SimpleNamespace(lost_peers=lambda: gone)
    return b


def test_a_timeout_names_a_peer_whose_process_is_gone_as_lost():
    b = _timed_out_backend({1: "its process 4242 has exited or was killed"})
    with pytest.raises(ep_comm.EPTimeoutError) as info:
        b.check_errors()
    err = info.value
    assert list(err.missing_ranks) == [1] and list(err.lost_ranks) == [1], err
    assert "no signal from rank(s) [1]" in str(err) and "rank 1 is gone (its process 4242" in str(err), err
    with pytest.raises(ep_comm.EPTimeoutError):  # the call sequence is broken: every later call raises it
        b.check_errors()


def test_a_timeout_without_evidence_names_the_peer_missing_only():
    b = _timed_out_backend({})
    with pytest.raises(ep_comm.EPTimeoutError) as info:
        b.check_errors()
    assert list(info.value.missing_ranks) == [1] and list(info.value.lost_ranks) == []


def test_the_owner_table_drops_the_experts_of_ranks_that_left():
    from ep_comm.backends.one_sided.device import expert_owner_table

    full = expert_owner_table(8, 4)
    assert full.tolist() == [(e // 2) * 65536 + e % 2 for e in range(8)]
    active = torch.tensor([True, True, True, True, False, False, True, True])  # rank 2 left
    shrunk = expert_owner_table(8, 4, active)
    assert shrunk.tolist() == [v if a else -1 for v, a in zip(full.tolist(), active.tolist())]
