"""Shrink and go on (collective family, CPU, gloo): a rank killed with SIGKILL mid-loop, the survivors
raise an EPTimeoutError naming it in ``lost_ranks``, call ``comm.shrink()`` and run on with every
result equal to the oracle over the active ranks, ``Dispatched.inactive_pairs`` equal to an
independent count; a second loss is shrunk the same way, and rank 0 (the rendezvous store's host) may
be the one lost."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.distributed.spawn import spawn_local
from ep_comm.errors import EPError, EPTimeoutError

TIMEOUT_S = 5.0
BACKENDS = ("naive", "ag_rs")
LAYOUTS = ("standard", "batched")
KILL_AT = 3  # the victim dies at a random moment of this iteration of the first communicator's loop


def _cfg(world: int, backend: str, layout: str) -> ep_comm.EPConfig:
    return ep_comm.EPConfig(num_experts=2 * world, top_k=3, hidden=16, max_tokens_per_rank=6, dtype=torch.float32,
                            layout=layout, backend=backend, timeout_s=TIMEOUT_S)


def _inputs(cfg: ep_comm.EPConfig, world: int, seed: int) -> list[oracle.RankInput]:
    tokens = torch.randint(0, cfg.max_tokens_per_rank + 1, (world,), generator=torch.Generator().manual_seed(seed))
    return oracle.random_inputs(cfg, world, seed, tokens=tokens.tolist(), p_minus_one=0.15, p_duplicate=0.2)


def _call(comm: ep_comm.Communicator, seed: int) -> list[str]:
    """One dispatch + combine on fresh inputs; the differences from the oracle (empty: none)."""
    cfg, rank, world, active = comm.cfg, comm.rank, comm.world_size, comm.active_ranks
    inputs = _inputs(cfg, world, seed)
    mine = inputs[rank]
    d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
    problems = oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs, active)[rank])
    y = comm.combine(oracle.run_experts(cfg, rank, world, d), d)
    problems += oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank, active_ranks=active))
    if len(active) == world:
        if d.inactive_pairs is not None:
            problems.append("inactive_pairs set while every rank is active")
    else:
        got = d.inactive_pairs
        want = oracle.expected_inactive_pairs(cfg, inputs, active)[rank]
        if got is None or got.dim() != 0 or got.dtype != torch.int64 or got.device != d.x.device:
            problems.append(f"inactive_pairs is {got!r}, expected a 0-dim int64 tensor")
        elif int(got) != want:
            problems.append(f"inactive_pairs {int(got)}, expected {want}")
    return [f"{comm.backend}/{cfg.layout} seed {seed}: {p}" for p in problems]


def _worker(victims: list[int], calls: int) -> dict:
    """Every rank: four communicators (both backends × both layouts); per victim: loop on the first one
    until the loss shows, then shrink all four and run ``calls`` checked calls on each."""
    topo = ep_comm.init_distributed(timeout_s=60)
    rank, world = topo.rank, topo.world_size
    comms = [ep_comm.Communicator(_cfg(world, b, lay)) for b in BACKENDS for lay in LAYOUTS]
    report: dict = {"errors": [], "problems": [], "calls": 0, "shrinks": []}
    try:
        comms[0].shrink()
        report["errors"].append("shrink() with no lost rank known did not raise")
    except EPError as exc:
        report["errors"].append(None if "no rank is known to be lost" in str(exc) else f"shrink(): {exc}")
    for bad in ([rank], [world]):
        try:
            comms[0].shrink(bad)
            report["errors"].append(f"shrink({bad}) did not raise")
        except EPError:
            report["errors"].append(None)
    # fresh inputs every call, the same on every rank (a seed per call); survivors may leave the loop
    # one call apart (a rank that finished the call the victim died in fails in the next one), so the
    # seeds after each shrink start from a fixed base
    for k, victim in enumerate(victims):
        seed = 100_000 * k
        for it in range(10_000):
            if rank == victim and it == KILL_AT:
                # at an arbitrary point of the next calls: inside a collective or between two
                threading.Timer(0.02 * torch.rand(()).item(), os.kill, (os.getpid(), signal.SIGKILL)).start()
            try:
                seed += 1
                report["problems"] += _call(comms[0], seed)
                report["calls"] += 1
            except EPTimeoutError as exc:
                report["shrinks"].append({"lost": list(exc.lost_ranks), "iteration": it, "msg": str(exc)})
                break
        seed = 100_000 * k + 50_000
        t0 = time.monotonic()
        # the first communicator drops the ranks its error named, the others those found gone now
        comms = [c.shrink() for c in comms]
        report["shrinks"][-1].update(active=list(comms[0].active_ranks), shrink_s=time.monotonic() - t0,
                                     all_active=[list(c.active_ranks) for c in comms])
        for comm in comms:
            for _ in range(calls):
                seed += 1
                report["problems"] += _call(comm, seed)
                report["calls"] += 1
    # after the loss of the store's host the survivors meet in file stores: the last to close removes each
    report["store_files"] = sorted({c.control.store_file for c in comms if c.control.store_file})
    for comm in comms:
        comm.close()
    t0 = time.monotonic()
    ep_comm.distributed.shutdown()
    report["teardown_s"] = time.monotonic() - t0
    return report


@pytest.mark.parametrize("world,victims,agreement", [
    (3, [1], "shm"),      # one loss in the middle
    (3, [0], "gloo"),     # the rendezvous store's host, agreement over gloo
    (4, [0, 2], "shm"),   # rank 0 first, then another: shrink twice
])
def test_kill_shrink_and_go_on(world: int, victims: list[int], agreement: str) -> None:
    env = {"CUDA_VISIBLE_DEVICES": ""} | ({} if agreement == "shm" else {"EP_COMM_SHM_AGREE": "0"})
    calls = 50  # per communicator and shrink: 200 checked calls over both backends and layouts
    results = spawn_local(_worker, world, (victims, calls), timeout_s=120, extra_env=lambda r: env,
                          preload=["torch", "ep_comm"])
    for v in victims:
        assert results[v].exitcode == -signal.SIGKILL, (results[v].error, results[v].traceback)
    survivors = [r for r in range(world) if r not in victims]
    for r in survivors:
        res = results[r]
        assert res.ok, f"rank {r}: {res.error_type}: {res.error}\n{res.traceback}"
        report = res.value
        assert report["errors"] == [None, None, None], report["errors"]
        assert report["problems"] == [], report["problems"][:5]
        active = list(range(world))
        assert len(report["shrinks"]) == len(victims), report["shrinks"]
        for victim, shrink in zip(victims, report["shrinks"]):
            active.remove(victim)
            assert shrink["lost"] == [victim], shrink["msg"]
            assert shrink["all_active"] == [active] * 4, shrink
        assert report["calls"] >= 4 * 50 * len(victims)
        assert report["teardown_s"] < 5.0, report
        assert len(report["store_files"]) == (4 if 0 in victims else 0), report["store_files"]
        left = [f for f in report["store_files"] if os.path.exists(f)]
        assert left == [], f"file stores not removed after every survivor closed: {left}"
