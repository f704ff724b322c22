"""Shrink and go on, kernel backends on GPUs: a rank killed with SIGKILL mid-loop, the survivors raise
an ``EPTimeoutError`` naming it in ``lost_ranks`` within timeout_s + 10 s, call ``comm.shrink()`` on
every communicator (the same mapped buffers, the lost rank neither signalled nor waited for) and run
checked calls, eager and CUDA-graph replays, both layouts: every result equals the oracle over the
active ranks and ``Dispatched.inactive_pairs`` an independent count.

World: one rank per GPU (at least 2; two ranks share a GPU on a one-GPU machine).  Skipped without CUDA.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import ep_comm
from ep_comm.backends.one_sided import layout as lay_mod
from ep_comm.distributed.spawn import spawn_local

from .. import cases
from ..shrink_checks import CapturedCall, eager_call
from .test_nvshmem import _why_skip as _why_no_nvshmem

pytestmark = [pytest.mark.gpu]

TIMEOUT_S = 5.0
KILL_AT = 3  # the victim dies at a random moment of this iteration of the loop
LAYOUTS = ("standard", "batched")


def _ngpu() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _graph_calls(comm, seed: int, replays: int) -> list[str]:
    """Capture dispatch + combine once, replay with fresh inputs (fixed T per rank), compare each."""
    graph = CapturedCall(comm, seed)
    return [p for rep in range(replays) for p in graph.replay(seed + 1 + rep)]


# the grouped combine forced on, on 2 SMs with 5 groups per peer: most send units come from the queue
GROUPED_QUEUE = dict(max_tokens=160, num_sms=2)


def shrink_worker(backend: str, victim: int, calls: int, grouped: bool = False) -> dict:
    """Every rank: one communicator per layout; loop on the first until the loss shows, then shrink
    them all and run ``calls`` eager calls and ``calls`` graph replays on each.  ``grouped``: the
    standard layout's combine grouped (interleaved) on GROUPED_QUEUE."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    victim %= world
    if grouped:
        os.environ[lay_mod.COMBINE_GROUPED_ENV] = "1"
    kw = GROUPED_QUEUE if grouped else {}
    comms = [ep_comm.Communicator(cases.make_cfg(world, backend, layout, None, timeout_s=TIMEOUT_S, **kw),
                                  device=device)
             for layout in LAYOUTS]
    report: dict = {"problems": [], "calls": 0}
    seed = 0
    t_kill = None
    for it in range(10_000):
        if it == KILL_AT:  # about when the victim dies (the ranks are within a call of each other)
            t_kill = time.monotonic()
            if rank == victim:
                threading.Timer(0.02 * torch.rand(()).item(), os.kill, (os.getpid(), signal.SIGKILL)).start()
        try:
            seed += 1
            report["problems"] += eager_call(comms[0], seed)
            report["calls"] += 1
        except ep_comm.EPTimeoutError as exc:
            report.update(lost=list(exc.lost_ranks), missing=list(exc.missing_ranks), msg=str(exc),
                          after_s=time.monotonic() - (t_kill or time.monotonic()))
            break
        except ep_comm.EPError as exc:
            report.update(lost=None, msg=f"{type(exc).__name__}: {exc}")
            break
    t0 = time.monotonic()
    comms = [c.shrink() for c in comms]
    report["shrink_s"] = time.monotonic() - t0
    report["active"] = [list(c.active_ranks) for c in comms]
    seed = 50_000  # survivors may have left the loop one call apart: a common base
    for comm in comms:
        for _ in range(calls):
            seed += 1
            report["problems"] += eager_call(comm, seed)
            report["calls"] += 1
        seed += 1000
        report["problems"] += _graph_calls(comm, seed, calls)
        report["calls"] += calls
    for comm in comms:
        comm.close()
    ep_comm.distributed.shutdown()
    return report


def _run(backend: str, victim: int, calls: int = 50, grouped: bool = False):
    world, env = cases.kernel_test_world(_ngpu())
    victim %= world
    results = spawn_local(shrink_worker, world, (backend, victim, calls, grouped), timeout_s=300, extra_env=env)
    assert results[victim].exitcode == -signal.SIGKILL, (results[victim].error, results[victim].traceback)
    for r in (r for r in range(world) if r != victim):
        res = results[r]
        assert res.ok, f"rank {r}: {res.error_type}: {res.error}\n{res.traceback}"
        report = res.value
        assert report["lost"] == [victim], report.get("msg")
        # the first call that could not complete raised within timeout_s plus the teardown slack
        assert report["after_s"] < TIMEOUT_S + 10, report
        assert report["active"] == [[a for a in range(world) if a != victim]] * len(LAYOUTS), report
        assert report["problems"] == [], report["problems"][:5]
        assert report["calls"] >= 2 * calls * len(LAYOUTS), report


@pytest.mark.parametrize("victim", [-1, 0], ids=["last_rank", "rank_0"])
def test_mnnvl_survivors_shrink_and_go_on(victim):
    _run("mnnvl", victim)


def test_mnnvl_survivors_shrink_with_grouped_send_units_from_the_queue():
    _run("mnnvl", -1, calls=20, grouped=True)


@pytest.mark.multigpu
@pytest.mark.skipif(bool(_why_no_nvshmem()), reason=_why_no_nvshmem() or "-")
def test_nvshmem_survivors_shrink_and_go_on():
    _run("nvshmem", -1)
