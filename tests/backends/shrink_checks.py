"""What the shrink tests of both families check after a loss: fresh inputs per call and one call's
results against the oracle over the active ranks, ``Dispatched.inactive_pairs`` against its own count;
an eager call and a captured call replayed with fresh inputs, each compared so."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

import ep_comm
from ep_comm import oracle

from . import cases


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
    problems += oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank, active_ranks=active))
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


def eager_call(comm: ep_comm.Communicator, seed: int) -> list[str]:
    """One eager dispatch + combine on fresh inputs, compared with the oracle over the active ranks."""
    cfg, rank, world = comm.cfg, comm.rank, comm.world_size
    inputs = shrink_inputs(cfg, world, seed)
    mine = inputs[rank].to(comm.device)
    d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
    y = comm.combine(cases.graph_experts(cfg, rank, world, d), d)
    comm.check_errors()  # a loss during this call raises here, before the results are compared
    return compare_with_active(comm, inputs, d, y, f"eager seed {seed}")


class CapturedCall:
    """dispatch + combine of ``comm`` captured once as a CUDA graph (fixed T per rank, the inputs of
    ``seed``) after an eager warm-up; ``replay(seed)`` runs it on that seed's inputs and compares."""

    def __init__(self, comm: ep_comm.Communicator, seed: int):
        cfg, rank, world = comm.cfg, comm.rank, comm.world_size
        self.comm, self.tokens = comm, [cfg.max_tokens_per_rank - r % 3 for r in range(world)]
        first = shrink_inputs(cfg, world, seed, self.tokens)[rank].to(comm.device)
        self.x, self.ids, self.w = first.x.clone(), first.topk_ids.clone(), first.topk_weights.clone()
        d = comm.dispatch(self.x, self.ids, self.w)  # eager warm-up: NCCL and cuBLAS set up outside the capture
        comm.combine(cases.graph_experts(cfg, rank, world, d), d)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.d = comm.dispatch(self.x, self.ids, self.w)
            self.y = comm.combine(cases.graph_experts(cfg, rank, world, self.d), self.d)

    def replay(self, seed: int) -> list[str]:
        comm = self.comm
        inputs = shrink_inputs(comm.cfg, comm.world_size, seed, self.tokens)
        mine = inputs[comm.rank].to(comm.device)
        self.x.copy_(mine.x), self.ids.copy_(mine.topk_ids), self.w.copy_(mine.topk_weights)
        self.graph.replay()
        torch.cuda.synchronize()  # behind a dead peer's kernel: until that ends (an abort, or its timeout)
        comm.check_errors()
        return compare_with_active(comm, inputs, self.d, self.y, f"replay seed {seed}")
