"""``ep-comm stress``'s cases: what one iteration draws from ``(--seed, iteration)`` alone, and the
inputs every rank builds from it."""
from __future__ import annotations

import argparse
import dataclasses
import random
from typing import Optional

import torch

from .. import oracle
from ..config import EPConfig


@dataclasses.dataclass
class Case:
    """Everything that defines one iteration's inputs (identical on every rank)."""

    iteration: int
    quant: Optional[str]
    payload: str  # "dtype" | "uint8"
    routing: str
    tokens: list[int]
    p_minus_one: float
    p_duplicate: float
    scales_width: int
    data_seed: int

    def describe(self) -> str:
        return (f"quant {self.quant or 'none'}, payload {self.payload}, routing {self.routing}, tokens per rank "
                f"{self.tokens}, p_minus_one {self.p_minus_one}, p_duplicate {self.p_duplicate}, "
                f"scales_width {self.scales_width}, data seed {self.data_seed}")


def plan(args: argparse.Namespace, iteration: int, world: int, fp8_ok: bool) -> Case:
    """The iteration's case, from ``(seed, iteration)`` only (str seeds hash the same in every process)."""
    rng = random.Random(f"ep-comm-stress:{args.seed}:{iteration}")
    quant = "fp8" if fp8_ok and rng.random() < 0.25 else None
    payload = "uint8" if quant is None and rng.random() < 0.15 else "dtype"
    routing = "skewed" if rng.random() < 0.3 else "uniform"
    if rng.random() < 0.03:
        tokens = [0] * world  # a round where nobody has tokens must still complete
    else:
        tokens = [0 if rng.random() < 0.15 else rng.randint(1, args.max_tokens) for _ in range(world)]
    if args.inject_fault and iteration == fault_iteration(args):
        tokens[world - 1] = max(1, tokens[world - 1])  # the corrupted rank needs a row to corrupt
    return Case(
        iteration=iteration, quant=quant, payload=payload, routing=routing, tokens=tokens,
        p_minus_one=rng.choice((0.0, 0.0, 0.1, 0.3)), p_duplicate=rng.choice((0.0, 0.0, 0.2, 0.5)),
        scales_width=rng.choice((0, 0, 3)) if payload == "dtype" and quant is None else 0,
        data_seed=rng.randrange(2**31),
    )


def fault_iteration(args: argparse.Namespace) -> int:
    return args.start + args.iters // 2


def case_inputs(cfg: EPConfig, case: Case) -> list[oracle.RankInput]:
    """``oracle.random_inputs`` for the case, with zero-token ranks filled in here.

    ``random_inputs(routing="skewed")`` raises for a rank with T=0 (its skew branch is skipped for
    T=0 and the routing name then falls through to the "unknown routing" error), so the non-empty
    ranks are generated in one call and empty inputs are inserted for the others.  Zero-size draws
    consume no random numbers, so the data equals what a fixed ``random_inputs`` would return.
    """
    live = [t for t in case.tokens if t]
    generated = iter(oracle.random_inputs(
        cfg, len(case.tokens), case.data_seed, tokens=live, routing=case.routing, payload=case.payload,
        scales_width=case.scales_width, p_minus_one=case.p_minus_one, p_duplicate=case.p_duplicate,
    ) if live else [])
    out = []
    for t in case.tokens:
        if t:
            out.append(next(generated))
            continue
        width = cfg.hidden // 2 if case.payload == "uint8" else cfg.hidden
        x = torch.empty(0, width, dtype=torch.uint8 if case.payload == "uint8" else cfg.dtype)
        s = torch.empty(0, case.scales_width) if case.scales_width else None
        out.append(oracle.RankInput(x, torch.empty(0, cfg.top_k, dtype=torch.int32),
                                    torch.empty(0, cfg.top_k, dtype=torch.float32), s))
    return out
