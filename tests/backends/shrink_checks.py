"""What the shrink tests of both families check after a loss: fresh inputs per call and one call's
results against the oracle over the active ranks, ``Dispatched.inactive_pairs`` against its own count."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

import ep_comm
from ep_comm import oracle


def shrink_inputs(cfg: ep_comm.EPConfig, world: int, seed: int,
                  tokens: Optional[Sequence[int]] = None) -> list[oracle.RankInput]:
    """Every rank's inputs for one call (``tokens`` per rank, else random up to max_tokens_per_rank),
    with -1 and repeated ids mixed in."""
    if tokens is None:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg.max_tokens_per_rank + 1, (world,), generator=gen).tolist()
    return oracle.random_inputs(cfg, world, seed, tokens=list(tokens), p_minus_one=0.15, p_duplicate=0.2)


def compare_with_active(comm: ep_comm.Communicator, inputs: list[oracle.RankInput], d, y, what: str) -> list[str]:
    """The differences of this rank's dispatch ``d`` and combine ``y`` from the oracle over
    ``comm.active_ranks`` (empty: none); after a shrink also ``inactive_pairs`` (a 0-dim int64 tensor on
    the device), which must be None while every rank is active."""
    cfg, rank, world, active = comm.cfg, comm.rank, comm.world_size, list(comm.active_ranks)
    problems = oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs, active)[rank])
    problems += oracle.compare_combine(cfg, y, oracle.expected_combine(cfg, inputs, active_ranks=active)[rank])
    if len(active) < world:
        want = oracle.expected_inactive_pairs(cfg, inputs, active)[rank]
        got = d.inactive_pairs
        if got is None or got.dim() != 0 or got.dtype != torch.int64 or got.device != d.x.device:
            problems.append(f"inactive_pairs is {got!r}, expected a 0-dim int64 tensor on the device")
        elif int(got) != want:
            problems.append(f"inactive_pairs {int(got)}, expected {want}")
    elif d.inactive_pairs is not None:
        problems.append("inactive_pairs set while every rank is active")
    return [f"{comm.backend}/{cfg.layout} active {active} {what}: {p}" for p in problems]
