"""The one-sided family's host protocol on CPU, against a stand-in for its kernels that records the calls.

The GPU tests (test_mnnvl.py, test_nvshmem.py) check the kernels end to end; here the order of what
``OneSidedBackend`` asks of its kernels and the errors it raises run in CI: the input verdict queued in
front of the launch and answered after it, bad input (a bad id, a bad shape, a peer's bad verdict)
raised in the same call and the communicator usable afterwards, bad input without a verdict abandoning
the call, and the receive-hook state machine.  One rank (a one-sided backend needs no peer for what is
checked here; a peer's verdict is what the stand-in reports).
"""
from __future__ import annotations

import types

import torch

import ep_comm
from ep_comm.backends import Availability
from ep_comm.backends.one_sided.errors import StatusReport, status_words
from ep_comm.backends.one_sided.layout import BufferLayout
from ep_comm.backends.one_sided.mnnvl import MnnvlBackend
from ep_comm.backends.protocol import Status
from ep_comm.distributed.spawn import raise_on_failure, spawn_local
from ep_comm.errors import EPError

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


class RecordingKernels:
    """Stands in for ``device.Kernels``: logs every launch, returns rows of the right shapes, and
    answers the input verdict from the ids it was given (as the verdict kernel does) and from
    ``peer_bad`` (the peers' verdicts: rank -> bits)."""

    num_blocks = 1

    def __init__(self, ctx):
        self.ctx, self.log = ctx, []
        self.zero_copy = ctx.cfg.zero_copy
        self._ids_ok = True
        self.peer_bad: dict[int, int] = {}
        self.dropped = 0  # ids an earlier launch treated as -1 (validation off), as the kernel counts them

    def read_expert_rows_from(self, rows) -> None:
        pass

    def dispatch(self, x, topk_ids, topk_weights, x_scales, phases):
        send_only = phases & 3 == 1
        self.log.append(f"dispatch{' send' if send_only else ''} checked={bool(phases & 4)}")
        cfg, n = self.ctx.cfg, self.ctx.world_size * self.ctx.cfg.max_tokens_per_rank
        rows = 0 if cfg.zero_copy else n
        return (torch.zeros(rows, cfg.hidden, dtype=x.dtype), torch.empty(0), torch.full((n, cfg.top_k), -1,
                dtype=torch.int32), torch.zeros(n, cfg.top_k), torch.empty(0, cfg.top_k, dtype=torch.int32),
                torch.empty(0, dtype=torch.int32), torch.full((x.shape[0], cfg.top_k), -1, dtype=torch.int32))

    def dispatch_recv(self, x, x_scales, outputs) -> None:
        self.log.append("dispatch receive")

    def combine(self, expert_out, row_ids, row_w, row_slot, dest, out, phases) -> None:
        self.log.append({1: "combine send", 2: "combine receive", 3: "combine"}[phases])
        out.zero_()

    def abort(self, calls: int) -> None:
        self.log.append(f"abort {calls}")

    def start_verdict(self, topk_ids) -> None:
        self.log.append("start_verdict")
        e = self.ctx.cfg.num_experts
        self._ids_ok = bool(((topk_ids >= -1) & (topk_ids < e)).all())

    def refuse(self) -> None:
        self.log.append("refuse")

    def wait_verdict(self) -> tuple[bool, bool]:
        self.log.append("wait_verdict")
        return not self._ids_ok, not self._ids_ok or bool(self.peer_bad)

    def bad_verdicts(self, rank: int) -> tuple[int, dict[int, int]]:
        return (7 << 2) | 1, dict(self.peer_bad)

    def fatal_pending(self) -> bool:
        return False

    def recoverable_pending(self) -> bool:
        return self.dropped > 0

    def take_record(self) -> StatusReport:
        words = [0] * status_words(self.ctx.world_size)
        words[Status.INVALID_IDS], self.dropped = self.dropped, 0
        return StatusReport.from_words(words, self.ctx.world_size)

    def flag_slots(self) -> list[list[int]]:
        return [[0] * self.ctx.world_size, [0] * self.ctx.world_size]

    def release(self) -> None:
        self.log.append("close")


class RecordingBackend(MnnvlBackend):
    """The family over a CPU buffer and the recording kernels."""

    @classmethod
    def availability(cls, ctx) -> Availability:
        return Availability(True)

    @classmethod
    def create(cls, ctx) -> RecordingBackend:
        layout = BufferLayout.for_config(ctx.cfg, ctx.world_size)
        buf = types.SimpleNamespace(local=torch.zeros(layout.nbytes, dtype=torch.uint8), peer_ptrs=None)
        return cls(ctx, buf, layout, RecordingKernels(ctx))

    def close(self) -> None:
        self.kernels.release()


def _calls(comm, fn) -> tuple[list[str], str]:
    """The backend calls ``fn()`` made (and ``close``-free), and what it raised ('' if nothing)."""
    log = comm._impl.kernels.log
    log.clear()
    try:
        fn()
        raised = ""
    except EPError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    return list(log), raised


def kernel_path_worker() -> dict:
    import ep_comm.backends as backends

    backends._REGISTRY["mnnvl"] = RecordingBackend  # this process only (a spawned rank)
    ep_comm.init_distributed()
    cfg = ep_comm.EPConfig(num_experts=8, top_k=2, hidden=64, max_tokens_per_rank=4, dtype=torch.bfloat16,
                           backend="mnnvl", timeout_s=30.0)
    x = torch.randn(3, cfg.hidden).to(cfg.dtype)
    ids = torch.tensor([[0, 5], [-1, 7], [2, 2]], dtype=torch.int32)
    bad = ids.clone()
    bad[1, 0] = 99
    w = torch.rand(3, cfg.top_k)
    out: dict = {}
    with ep_comm.Communicator(cfg) as comm:
        assert isinstance(comm._impl, RecordingBackend)
        holder: dict = {}

        def dispatch(i=ids, **kw):
            holder["d"] = comm.dispatch(x, i, w, **kw)

        out["clean"] = _calls(comm, dispatch)
        n = holder["d"].x.shape[0]
        out["combine"] = _calls(comm, lambda: comm.combine(torch.zeros(n, cfg.hidden, dtype=cfg.dtype), holder["d"]))

        def hooked():
            d, hook = comm.dispatch(x, ids, w, return_recv_hook=True)
            holder["hook"] = hook
        out["hook send"] = _calls(comm, hooked)
        out["call before the hook"] = _calls(comm, dispatch)
        out["hook"] = _calls(comm, lambda: holder["hook"]())
        out["shape error"] = _calls(comm, lambda: comm.dispatch(x[:2], ids, w))
        out["after the shape error"] = _calls(comm, dispatch)
        out["bad id"] = _calls(comm, lambda: comm.dispatch(x, bad, w))
        out["after the bad id"] = _calls(comm, dispatch)
        comm._impl.kernels.peer_bad = {1: 2, 3: 1}
        out["peer's bad input"] = _calls(comm, dispatch)
        comm._impl.kernels.peer_bad = {}
        out["after the peer's bad input"] = _calls(comm, dispatch)
        n = holder["d"].x.shape[0]
        out["combine shape error"] = _calls(comm, lambda: comm.combine(torch.zeros(n, 3, dtype=cfg.dtype), holder["d"]))
        out["after the combine error"] = _calls(comm, dispatch)
    with ep_comm.Communicator(cfg.replace(validate_ids=False)) as comm:
        out["bad id, validation off"] = _calls(comm, lambda: comm.dispatch(x, bad, w))
        comm._impl.kernels.dropped = 1  # what the kernel counted in that launch
        out["validation off, next dispatch"] = _calls(comm, dispatch)
        n = holder["d"].x.shape[0]
        out["validation off, its combine"] = _calls(
            comm, lambda: comm.combine(torch.zeros(n, cfg.hidden, dtype=cfg.dtype), holder["d"]))
        out["validation off, shape error"] = _calls(comm, lambda: comm.dispatch(x[:2], ids, w))
        out["validation off, after the shape error"] = _calls(comm, dispatch)
    zc = cfg.replace(zero_copy=True, validate_ids=False)
    with ep_comm.Communicator(zc) as comm:  # dispatch, combine, dispatch: in step
        d = comm.dispatch(x, ids, w)
        out["zero copy, combined"] = _calls(comm, lambda: comm.combine(torch.zeros_like(d.x), d))
        out["zero copy, next dispatch"] = _calls(comm, lambda: comm.dispatch(x, ids, w))
    with ep_comm.Communicator(zc) as comm:  # a second dispatch would overwrite the rows still in use
        comm.dispatch(x, ids, w)
        out["zero copy, uncombined"] = _calls(comm, lambda: comm.dispatch(x, ids, w))
    with ep_comm.Communicator(zc) as comm:  # a traced graph could not order reads of the views
        real, torch.compiler.is_compiling = torch.compiler.is_compiling, lambda: True
        try:
            out["zero copy, compiling"] = _calls(comm, lambda: comm.dispatch(x, ids, w))
        finally:
            torch.compiler.is_compiling = real
    return out


def test_kernel_path_orders_validation_launch_and_hooks():
    res = raise_on_failure(spawn_local(kernel_path_worker, 1, timeout_s=120, extra_env=lambda r: CPU_ONLY))[0]
    checked = ["start_verdict", "dispatch checked=True", "wait_verdict"]
    # the verdict is queued before the launch and answered after it, so the GPU never waits for the host
    assert res["clean"] == (checked, "")
    assert res["combine"] == (["combine"], "")
    assert res["hook send"] == (["start_verdict", "dispatch send checked=True", "wait_verdict"], "")
    calls, raised = res["call before the hook"]
    assert calls == [] and raised.startswith("EPError") and "receive hook" in raised
    assert res["hook"] == (["dispatch receive"], "")
    # a bad shape is found before anything is launched: the peers get a bad verdict, no dispatch runs,
    # and the next call works
    calls, raised = res["shape error"]
    assert calls == ["refuse"] and raised.startswith("EPInputError"), (calls, raised)
    assert res["after the shape error"] == (checked, "")
    # a bad id: the verdict says so (every rank's kernel skips the call), the error names the token,
    # and the communicator stays usable
    calls, raised = res["bad id"]
    assert calls == checked and raised.startswith("EPInputError") and "topk_ids[1, 0] = 99" in raised, raised
    assert res["after the bad id"] == (checked, "")
    # a peer's bad input: this rank raises in the same call, naming the peers and what was wrong
    calls, raised = res["peer's bad input"]
    assert calls == checked and raised.startswith("EPInputError"), raised
    assert "dispatch #7" in raised and "[1, 3]" in raised and "rank 1: topk_ids out of range" in raised, raised
    assert "rank 3: input its host refused" in raised and "stays usable" in raised, raised
    assert res["after the peer's bad input"] == (checked, "")
    # a combine's bad input: abandoned with an abort (the peers go on without this rank's part), and
    # the next call works (every rank's next call is a dispatch)
    calls, raised = res["combine shape error"]
    assert calls == ["abort 1"] and raised.startswith("EPInputError"), (calls, raised)
    assert res["after the combine error"] == (checked, "")
    # validation off: no verdict; the kernel counts the id and a later combine raises it
    assert res["bad id, validation off"] == (["dispatch checked=False"], "")
    # the count is raised by the next combine, after its launch: a dispatch that raised after going out
    # would leave this rank without the rows its peers then combine
    assert res["validation off, next dispatch"] == (["dispatch checked=False"], "")
    calls, raised = res["validation off, its combine"]
    assert calls == ["combine"] and raised.startswith("EPInputError") and "treated as -1" in raised, (calls, raised)
    # validation off, a bad shape: abandoned with an abort of two call numbers (the dispatch and the
    # combine the peers' hosts are on their way to), and the next call works
    calls, raised = res["validation off, shape error"]
    assert calls == ["abort 2"] and raised.startswith("EPInputError"), (calls, raised)
    assert res["validation off, after the shape error"] == (["dispatch checked=False"], "")
    # zero copy: a dispatch must follow the combine of the previous one; otherwise it is refused before
    # anything is launched and the peers are told
    assert res["zero copy, combined"] == (["combine"], "")
    assert res["zero copy, next dispatch"] == (["dispatch checked=False"], "")
    calls, raised = res["zero copy, uncombined"]
    assert calls == ["abort 2"] and raised.startswith("EPError") and "zero_copy: dispatch 0" in raised, (calls, raised)
    calls, raised = res["zero copy, compiling"]
    assert calls == [] and raised.startswith("EPConfigError") and "torch.compile" in raised, (calls, raised)
