"""Shrink and go on, collective backends on NCCL, one rank per GPU: a rank killed with SIGKILL mid-loop,
the survivors raise an ``EPTimeoutError`` naming it in ``lost_ranks`` within timeout_s + 10 s, call
``comm.shrink()`` on every communicator (naive and ag_rs, standard and batched layouts) and run 200
checked calls, eager and CUDA-graph replays: every result equals the oracle over the active ranks and
``Dispatched.inactive_pairs`` an independent count.

Three ways to die: at a random moment of an iteration of eager calls (sometimes inside a collective,
sometimes between the host agreement and the collective), at a random moment of an iteration of
CUDA-graph replays, and right after the host agreed on a dispatch, so that every survivor's all-gather
waits for it on the GPU and only the abort of the survivors' own NCCL group lets their hosts go on.

World: one rank per GPU; 2 ranks, and 4 where 4 GPUs exist.  Skipped without them (conftest: gpu,
multigpu).  Run: ``python3 -m pytest -v -m "gpu or multigpu" tests/backends/collective/test_shrink_gpu.py``.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time

import pytest
import torch

import ep_comm
from ep_comm.distributed.control import OP_DISPATCH
from ep_comm.distributed.groups import is_own_nccl
from ep_comm.distributed.spawn import spawn_local

from .. import cases
from ..shrink_checks import CapturedCall, eager_call

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

TIMEOUT_S = 5.0
KILL_AT = 3  # the iteration of the first loop in which the victim dies
BACKENDS = ("naive", "ag_rs")
LAYOUTS = ("standard", "batched")
CALLS = 25  # per communicator after the shrink: this many eager calls and as many graph replays (4 × 50 = 200)
STUCK_COMM = 2  # "stuck" mode: the victim dies right after agreeing on this communicator's dispatch (ag_rs)
SPAWN_TIMEOUT_S = 150.0


def _ngpu() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _die_after_agreeing(comm_index: int, comms: list) -> threading.Event:
    """Arm the victim: once the returned event is set, it SIGKILLs itself right after the host agreement
    of communicator ``comm_index``'s next dispatch, before its collective is queued."""
    from ep_comm.backends.collective.agreement import HostAgreement

    armed, target = threading.Event(), comms[comm_index]._impl.agreement
    real = HostAgreement.agree

    def agree(self, op, epoch, num_tokens, error=None):
        records = real(self, op, epoch, num_tokens, error)
        if armed.is_set() and self is target and op == OP_DISPATCH:
            os.kill(os.getpid(), signal.SIGKILL)
        return records

    HostAgreement.agree = agree  # type: ignore[method-assign]
    return armed


def shrink_worker(mode: str, victim: int, calls: int) -> dict:
    """Every rank: the four communicators; loop on them (eager calls or graph replays, ``mode``) until
    the loss shows, then shrink them all and run ``calls`` eager calls and ``calls`` replays on each."""
    faulthandler.dump_traceback_later(SPAWN_TIMEOUT_S - 15, exit=False)  # a hang shows every thread's stack
    topo = ep_comm.init_distributed(timeout_s=60)
    world, rank = topo.world_size, topo.rank
    victim %= world
    t0 = time.monotonic()
    comms = [ep_comm.Communicator(cases.make_cfg(world, b, lay, None, timeout_s=TIMEOUT_S))
             for b in BACKENDS for lay in LAYOUTS]
    report: dict = {"problems": [], "calls": 0, "lost": None, "create_s": time.monotonic() - t0,
                    "own_nccl": [is_own_nccl(c._impl.ctx.group) for c in comms]}
    graphs = [CapturedCall(c, 1000 * i) for i, c in enumerate(comms)] if mode == "graph" else []
    armed = _die_after_agreeing(STUCK_COMM, comms) if mode == "stuck" and rank == victim else None
    seed, t_kill = 0, None
    for it in range(10_000):
        if it == KILL_AT:  # about when the victim dies (the ranks are within a call of each other)
            t_kill = time.monotonic()
            if rank == victim:
                if armed is not None:
                    armed.set()
                else:  # at an arbitrary point of this iteration: inside a collective or between two
                    threading.Timer(0.03 * torch.rand(()).item(), os.kill, (os.getpid(), signal.SIGKILL)).start()
        where, current = None, 0
        try:
            for current, comm in enumerate(comms):
                seed += 1
                where = f"{comm.backend}/{comm.cfg.layout} {mode} iteration {it}"
                report["problems"] += graphs[current].replay(seed) if graphs else eager_call(comm, seed)
                report["calls"] += 1
        except ep_comm.EPTimeoutError as exc:
            report.update(lost=list(exc.lost_ranks), missing=list(exc.missing_ranks), msg=str(exc), where=where,
                          after_s=time.monotonic() - (t_kill or time.monotonic()),
                          aborted_at_raise=comms[current].control.nccl_aborted)
            # the other communicators made no call: their watchers abort their groups on their own
            deadline = time.monotonic() + 2.0
            while not all(c.control.nccl_aborted for c in comms) and time.monotonic() < deadline:
                time.sleep(0.02)
            report["aborted"] = [c.control.nccl_aborted is not None for c in comms]
            break
        except ep_comm.EPError as exc:
            report.update(msg=f"{type(exc).__name__} in {where}: {exc}")
            break
        if it > KILL_AT + 50:
            report["msg"] = f"no error within 50 iterations after the kill ({where})"
            break
    del graphs  # captured over the aborted groups: never to be replayed again
    t0 = time.monotonic()
    comms = [c.shrink() for c in comms]
    report["shrink_s"] = time.monotonic() - t0
    report["active"] = [list(c.active_ranks) for c in comms]
    report["own_nccl_after"] = [is_own_nccl(c._impl.ctx.group) for c in comms]
    seed = 50_000  # survivors may have left the loop one call apart: a common base
    t0 = time.monotonic()
    for i, comm in enumerate(comms):
        for _ in range(calls):
            seed += 1
            report["problems"] += eager_call(comm, seed)
            report["calls"] += 1
        graph = CapturedCall(comm, 60_000 + 1000 * i)
        for _ in range(calls):
            seed += 1
            report["problems"] += graph.replay(seed)
            report["calls"] += 1
    report["after_shrink_s"] = time.monotonic() - t0
    for comm in comms:
        comm.close()
    ep_comm.distributed.shutdown()
    faulthandler.cancel_dump_traceback_later()
    return report


WORLDS = [2, pytest.param(4, marks=pytest.mark.skipif(_ngpu() < 4, reason=f"needs 4 CUDA GPUs (found {_ngpu()})"))]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"world{w}")
@pytest.mark.parametrize("mode,victim", [("eager", -1), ("graph", 0), ("stuck", -1)],
                         ids=["eager_kill_last_rank", "graph_kill_rank_0", "stuck_kill_last_rank"])
def test_collective_survivors_shrink_and_go_on(world: int, mode: str, victim: int) -> None:
    victim %= world
    results = spawn_local(shrink_worker, world, (mode, victim, CALLS), timeout_s=SPAWN_TIMEOUT_S, preload=["torch"])
    assert results[victim].exitcode == -signal.SIGKILL, (
        f"victim rank {victim} was not killed by SIGKILL (exit code {results[victim].exitcode}): "
        f"{results[victim].error_type}: {results[victim].error}\n{results[victim].traceback}")
    survivors = [r for r in range(world) if r != victim]
    for r in survivors:
        res = results[r]
        assert res.ok, f"survivor rank {r} ({mode}): {res.error_type}: {res.error}\n{res.traceback}"
        rep = res.value
        brief = {k: v for k, v in rep.items() if k != "problems"}
        assert rep["own_nccl"] == [True] * 4, f"rank {r}: the data groups are not the plane's NCCL groups: {brief}"
        assert rep["lost"] == [victim], f"rank {r}: expected EPTimeoutError with lost_ranks [{victim}]: {brief}"
        # the first call that could not complete raised within timeout_s plus the teardown slack
        assert rep["after_s"] < TIMEOUT_S + 10, f"rank {r}: the loss took {rep['after_s']:.1f} s to show: {brief}"
        assert rep["aborted_at_raise"], (f"rank {r}: the NCCL group of the communicator that raised was not aborted "
                                         f"before the error reached the caller: {brief}")
        assert rep["aborted"] == [True] * 4, (f"rank {r}: 2 s after the error not every communicator's NCCL group "
                                              f"was aborted (the others by their watchers): {brief}")
        assert rep["active"] == [survivors] * 4, f"rank {r}: active ranks after the shrink: {brief}"
        assert rep["own_nccl_after"] == [True] * 4, f"rank {r}: the survivors' data groups are not NCCL: {brief}"
        assert rep["problems"] == [], f"rank {r}: {len(rep['problems'])} mismatches, first: {rep['problems'][:5]}"
        assert rep["calls"] >= 4 * 2 * CALLS, f"rank {r}: only {rep['calls']} checked calls: {brief}"
