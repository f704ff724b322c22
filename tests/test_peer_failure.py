"""A peer that dies (kill -9) or leaves with an exception: every other rank gets an EPTimeoutError that
names it, within timeout_s + 10 s, and the process can still shut down (nothing hangs)."""
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

TIMEOUT_S = 4.0
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _cfg(world: int) -> ep_comm.EPConfig:
    return ep_comm.EPConfig(num_experts=4 * world, top_k=3, hidden=64, max_tokens_per_rank=16, dtype=torch.bfloat16,
                            layout="batched", backend="ag_rs", timeout_s=TIMEOUT_S)


def _stamp(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


def _loop_until_failure(comm: ep_comm.Communicator, cfg: ep_comm.EPConfig, rank: int, world: int,
                        on_iteration=None) -> dict:
    """dispatch/combine rounds until one raises; returns what the survivor saw."""
    for it in range(100000):
        if on_iteration is not None:
            on_iteration(it)
        inp = oracle.random_inputs(cfg, world, seed=it)[rank]
        try:
            d = comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)
            comm.combine(oracle.run_experts(cfg, rank, world, d), d)
        except Exception as exc:  # noqa: BLE001 - the test looks at the type
            lost = list(getattr(exc, "lost_ranks", ()))
            return {"type": type(exc).__name__, "msg": str(exc), "lost": lost, "when": time.time(), "iteration": it}
    return {"type": None}


def _killed_worker(victim: int, stamp: str) -> dict:
    topo = ep_comm.init_distributed(timeout_s=60)
    cfg = _cfg(topo.world_size)
    comm = ep_comm.Communicator(cfg)

    def die_soon(it: int) -> None:
        if topo.rank == victim and it == 3:
            # at an arbitrary point of the next calls, inside a collective or between two
            def kill() -> None:
                _stamp(stamp)
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Timer(0.05 + 0.3 * torch.rand(()).item(), kill).start()

    seen = _loop_until_failure(comm, cfg, topo.rank, topo.world_size, die_soon)
    t0 = time.monotonic()
    comm.close()
    ep_comm.distributed.shutdown()  # must not hang with a dead peer
    seen["teardown_s"] = time.monotonic() - t0
    return seen


def _raising_worker(victim: int, stamp: str) -> dict:
    topo = ep_comm.init_distributed(timeout_s=60)
    cfg = _cfg(topo.world_size)

    def fail(it: int) -> None:
        if topo.rank == victim and it == 3:
            _stamp(stamp)
            raise KeyError("a bug in the engine between two calls")

    with ep_comm.Communicator(cfg) as comm:
        seen = _loop_until_failure(comm, cfg, topo.rank, topo.world_size, fail)
    return seen


def _check_survivors(results, victim: int, stamp: str, how: str) -> None:
    with open(stamp) as f:
        t_fail = float(f.read())
    for res in results:
        if res.rank == victim:
            continue
        assert res.ok, f"rank {res.rank}: {res.error_type}: {res.error}\n{res.traceback}"
        seen = res.value
        assert seen["type"] == "EPTimeoutError", f"rank {res.rank}: {seen}"
        assert seen["lost"] == [victim], f"rank {res.rank}: {seen['msg']}"
        assert f"rank {victim} is gone ({how}" in seen["msg"], f"rank {res.rank}: {seen['msg']}"
        assert seen["when"] - t_fail < TIMEOUT_S + 10, f"rank {res.rank}: {seen['when'] - t_fail:.1f} s"
        assert seen.get("teardown_s", 0.0) < 5.0, seen


@pytest.mark.parametrize("agreement", ["shm", "gloo"])  # same-host shared-memory agreement, or gloo
@pytest.mark.parametrize("nproc,victim", [(2, 1), (3, 0)])
def test_killed_rank_is_named_on_every_survivor(tmp_path, nproc: int, victim: int, agreement: str) -> None:
    stamp = str(tmp_path / "killed_at")
    env = CPU_ONLY if agreement == "shm" else {**CPU_ONLY, "EP_COMM_SHM_AGREE": "0"}
    results = spawn_local(_killed_worker, nproc, (victim, stamp), timeout_s=120, extra_env=lambda r: env)
    assert results[victim].exitcode == -signal.SIGKILL
    _check_survivors(results, victim, stamp, "its process")


def test_rank_raising_between_calls_is_named_on_every_survivor(tmp_path) -> None:
    stamp = str(tmp_path / "raised_at")
    results = spawn_local(_raising_worker, 3, (1, stamp), timeout_s=120, extra_env=lambda r: CPU_ONLY)
    assert results[1].error_type == "KeyError"
    _check_survivors(results, 1, stamp, "it closed its end of the communicator: closed after KeyError")
