"""Communicators and exchanges give back what they open: 200 create/use/close cycles in one process
leave the process groups, threads and open file descriptors where they were after warm-up."""
from __future__ import annotations

import os
import threading

import torch

import ep_comm
from ep_comm import oracle
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

CYCLES = 200
WARMUP = 5  # first cycles may create lazily-built, process-wide state once (allowed, constant)
# What may differ between the end and the post-warm-up count.  A leak of one fd, thread or group per
# cycle would show up as ~195; these tolerate only noise of a constant size.
SLACK = {"fds": 2, "threads": 0, "tasks": 1, "torch_groups": 0, "control_planes": 0, "shadow_gloo_groups": 0}


def _count() -> dict[str, int]:
    from torch.distributed import distributed_c10d

    from ep_comm.distributed.control import open_control_planes
    from ep_comm.distributed.exchange import cached_gloo_groups

    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),  # Python threads
        "tasks": len(os.listdir("/proc/self/task")),  # every OS thread, gloo's C++ workers included
        "torch_groups": len(distributed_c10d._world.pg_map),
        "control_planes": open_control_planes(),
        "shadow_gloo_groups": cached_gloo_groups(),
    }


def _cycles_worker(cycles: int) -> dict:
    import torch.distributed as dist

    from ep_comm.distributed import exchange as exmod
    from ep_comm.distributed.exchange import TorchExchange

    topo = ep_comm.init_distributed(timeout_s=60)
    world, rank = topo.world_size, topo.rank
    cfg = ep_comm.EPConfig(num_experts=4 * world, top_k=2, hidden=32, max_tokens_per_rank=4, dtype=torch.float32,
                           layout="standard", backend="ag_rs", timeout_s=30.0)
    inputs = oracle.random_inputs(cfg, world, seed=3)
    mine = inputs[rank]
    expected = oracle.expected_combine_rank(cfg, inputs, rank)

    def settled() -> dict[str, int]:
        dist.barrier()  # every rank has finished the previous close before anyone counts
        return _count()

    counts, problems = {}, []
    real = exmod._supports_cpu_tensors
    for i in range(cycles):
        with ep_comm.Communicator(cfg) as comm:
            d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
            y = comm.combine(oracle.run_experts(cfg, rank, world, d), d)
        if i < 3:  # the data path is exercised; checking it once is enough
            problems += oracle.compare_combine(cfg, y, expected)
        # The memory layer's exchange as it runs over NCCL: the default group cannot carry CPU
        # tensors there, so TorchExchange builds a shadow gloo group that close() must destroy.
        exmod._supports_cpu_tensors = lambda d_, g_: False
        try:
            with TorchExchange() as ex:
                got = ex.allgather_bytes(bytes([rank]))
        finally:
            exmod._supports_cpu_tensors = real
        if got != [bytes([r]) for r in range(world)]:
            problems.append(f"cycle {i}: exchange returned {got}")
        if i + 1 in (WARMUP, cycles // 2, cycles):
            counts[i + 1] = settled()
    return {"counts": counts, "problems": problems}


def test_create_close_cycles_leave_groups_threads_and_fds_flat():
    values = raise_on_failure(spawn_local(_cycles_worker, 2, (CYCLES,), timeout_s=540,
                                          extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
    for rank, v in enumerate(values):
        assert v["problems"] == [], f"rank {rank}: {v['problems']}"
        base, mid, end = (v["counts"][k] for k in (WARMUP, CYCLES // 2, CYCLES))
        assert end["control_planes"] == 0 and end["shadow_gloo_groups"] == 0, (rank, end)
        for what, slack in SLACK.items():
            grew = end[what] - base[what]
            assert grew <= slack, (f"rank {rank}: {what} went from {base[what]} after {WARMUP} cycles to "
                                   f"{mid[what]} after {CYCLES // 2} and {end[what]} after {CYCLES}")
