"""The communicator's kernel-backend path on CPU, against a stand-in that records the backend calls.

The GPU tests (tests/backends/test_mnnvl.py, test_nvshmem.py) check the kernels end to end; here the
order of the calls the communicator makes into a kernel backend and the errors it raises run in CI:
eager id validation queued in front of the launch and answered after it, a bad id abandoning the call
in the kernel (no separate abort), bad shapes abandoning it before the launch, and the receive-hook
state machine.  One rank (a kernel backend needs no peer for what is checked here).
"""
from __future__ import annotations

from typing import Optional

import torch

import ep_comm
from ep_comm.backends import Availability
from ep_comm.distributed.spawn import raise_on_failure, spawn_local
from ep_comm.errors import EPError
from ep_comm.layouts import Dispatched

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


class RecordingKernelBackend:
    """Stands in for ``mnnvl``: logs every call, returns zero rows of the right shapes, and answers the
    id check from the ids it was given (as the check kernel does)."""

    name = "mnnvl"
    graph_capturable = True
    kernel = True
    recv_hooks = True
    num_sms = 1

    def __init__(self, ctx):
        self.ctx = ctx
        self.log: list[str] = []
        self.fatal: Optional[EPError] = None
        self._ids_ok = True
        self.zero_copy = ctx.cfg.zero_copy

    @classmethod
    def availability(cls, ctx) -> Availability:
        return Availability(True)

    @classmethod
    def create(cls, ctx) -> "RecordingKernelBackend":
        return cls(ctx)

    def close(self) -> None:
        self.log.append("close")

    def check_inputs(self, x, x_scales) -> None:
        self.log.append("check_inputs")

    def start_id_check(self, topk_ids: torch.Tensor) -> None:
        self.log.append("start_id_check")
        e = self.ctx.cfg.num_experts
        self._ids_ok = bool(((topk_ids >= -1) & (topk_ids < e)).all())

    def id_check_passed(self) -> bool:
        self.log.append("id_check_passed")
        return self._ids_ok

    def _dispatched(self, x, epoch) -> Dispatched:
        cfg, n = self.ctx.cfg, self.ctx.world_size * self.ctx.cfg.max_tokens_per_rank
        return Dispatched(layout="standard", x=torch.zeros(n, cfg.hidden, dtype=x.dtype),
                          topk_ids=torch.full((n, cfg.top_k), -1, dtype=torch.int32),
                          topk_weights=torch.zeros(n, cfg.top_k), num_tokens=x.shape[0], epoch=epoch)

    def dispatch(self, x, topk_ids, topk_weights, x_scales, epoch, abandon_on_invalid=False) -> Dispatched:
        self.log.append(f"dispatch abandon_on_invalid={abandon_on_invalid}")
        return self._dispatched(x, epoch)

    def dispatch_split(self, x, topk_ids, topk_weights, x_scales, epoch, abandon_on_invalid=False):
        self.log.append(f"dispatch send abandon_on_invalid={abandon_on_invalid}")
        return self._dispatched(x, epoch), lambda: self.log.append("dispatch receive")

    def combine(self, expert_out, dispatched, out) -> torch.Tensor:
        self.log.append("combine")
        return out.zero_()

    def combine_split(self, expert_out, dispatched, out):
        self.log.append("combine send")
        return lambda: self.log.append("combine receive")

    def abort(self, reason: BaseException) -> None:
        self.log.append("abort")
        self.fatal = self.fatal or EPError(f"abandoned after {reason}")

    def abandoned_in_kernel(self, reason: BaseException) -> None:
        self.log.append("abandoned_in_kernel")
        self.fatal = self.fatal or EPError(f"abandoned in the kernel after {reason}")

    def poll_errors(self) -> None:
        if self.fatal is not None:
            raise self.fatal

    def recoverable_pending(self) -> bool:
        return False

    def check_errors(self) -> None:
        self.poll_errors()


def _calls(comm, fn) -> tuple[list[str], str]:
    """The backend calls ``fn()`` made (and ``close``-free), and what it raised ('' if nothing)."""
    impl = comm._impl
    impl.log.clear()
    try:
        fn()
        raised = ""
    except EPError as exc:
        raised = f"{type(exc).__name__}: {exc}"
    return list(impl.log), raised


def kernel_path_worker() -> dict:
    import ep_comm.backends as backends

    backends._REGISTRY["mnnvl"] = RecordingKernelBackend  # this process only (a spawned rank)
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
        assert isinstance(comm._impl, RecordingKernelBackend)
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
    with ep_comm.Communicator(cfg) as comm:
        out["bad id"] = _calls(comm, lambda: comm.dispatch(x, bad, w))
        out["after the bad id"] = _calls(comm, lambda: comm.dispatch(x, ids, w))
    with ep_comm.Communicator(cfg.replace(validate_ids=False)) as comm:
        out["bad id, validation off"] = _calls(comm, lambda: comm.dispatch(x, bad, w))
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
    # the check is queued before the launch and answered after it, so the GPU never waits for the host
    assert res["clean"] == (["check_inputs", "start_id_check", "dispatch abandon_on_invalid=True",
                             "id_check_passed"], "")
    assert res["combine"] == (["combine"], "")
    assert res["hook send"] == (["check_inputs", "start_id_check", "dispatch send abandon_on_invalid=True",
                                 "id_check_passed"], "")
    calls, raised = res["call before the hook"]
    assert calls == [] and raised.startswith("EPError") and "receive hook" in raised
    assert res["hook"] == (["dispatch receive"], "")
    # a bad shape is found before anything is launched: the peers are told by an abort
    calls, raised = res["shape error"]
    assert "abort" in calls and not any(c.startswith("dispatch") for c in calls), calls
    assert raised.startswith("EPInputError"), raised
    # a bad id: the dispatch kernel itself abandoned the call (no second signal), the error names the token
    calls, raised = res["bad id"]
    assert calls == ["check_inputs", "start_id_check", "dispatch abandon_on_invalid=True", "id_check_passed",
                     "abandoned_in_kernel"], calls
    assert raised.startswith("EPInputError") and "topk_ids[1, 0] = 99" in raised, raised
    calls, raised = res["after the bad id"]
    assert calls == [] and raised.startswith("EPError") and "abandoned" in raised, (calls, raised)
    # validation off: no check, no abandoning; the kernel counts the id and a later call raises
    assert res["bad id, validation off"] == (["check_inputs", "dispatch abandon_on_invalid=False"], "")
    # zero copy: a dispatch must follow the combine of the previous one; otherwise it is refused before
    # anything is launched and the peers are told
    assert res["zero copy, combined"] == (["combine"], "")
    assert res["zero copy, next dispatch"] == (["check_inputs", "dispatch abandon_on_invalid=False"], "")
    calls, raised = res["zero copy, uncombined"]
    assert calls == ["abort"] and raised.startswith("EPError") and "zero_copy: dispatch 0" in raised, (calls, raised)
    calls, raised = res["zero copy, compiling"]
    assert calls == [] and raised.startswith("EPConfigError") and "torch.compile" in raised, (calls, raised)
