"""A small expert-parallel MoE layer on ep_comm, checked against a dense single-process reference.

    torchrun --nproc-per-node 2 examples/moe_layer.py      # one rank per GPU (NCCL) or CPU ranks (gloo)
    python examples/moe_layer.py --nproc 2                  # spawns its own ranks

Each rank owns ``experts / world`` experts.  A forward pass is what an inference engine does:

    router logits -> ep_comm.routing.topk (NaN-safe) -> softmax weights
    -> comm.dispatch (layout="batched": [local experts, capacity, hidden] + tokens per expert)
    -> one MLP per local expert on d.x[e, :n]
    -> comm.combine (applies the routing weights, sums over experts and ranks) -> [T, hidden]

Every rank builds the same router and expert weights and every rank's input from one seed, so each
rank can also compute its own tokens' output densely (all experts, no communication) and compare.
"""
from __future__ import annotations

import argparse
import sys

import torch

import ep_comm
from ep_comm.distributed.spawn import run_or_spawn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Weights:
    """Router and expert MLP weights of the whole layer, identical on every rank (same seed)."""

    def __init__(self, hidden: int, ffn: int, experts: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.router = torch.randn(hidden, experts, generator=g) / hidden**0.5
        self.w_in = torch.randn(experts, hidden, ffn, generator=g) / hidden**0.5
        self.w_out = torch.randn(experts, ffn, hidden, generator=g) / ffn**0.5

    def to(self, device: torch.device) -> Weights:
        for name in ("router", "w_in", "w_out"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and their softmax weights (float32), as a DeepSeek/Mixtral-style router does."""
    logits = x.float() @ router
    values, ids = ep_comm.routing.topk(logits, top_k)  # NaN-safe: k distinct ids even for a NaN row
    return ids, torch.softmax(values, dim=-1)


def expert_mlp(x: torch.Tensor, w: Weights, expert: int) -> torch.Tensor:
    """One expert: SiLU MLP computed in float32."""
    return torch.nn.functional.silu(x.float() @ w.w_in[expert]) @ w.w_out[expert]


class EPMoELayer:
    """The expert-parallel layer: this rank runs only its own experts."""

    def __init__(self, comm: ep_comm.Communicator, weights: Weights, top_k: int):
        self.comm, self.w, self.top_k = comm, weights, top_k
        self.first_expert = comm.rank * comm.num_local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(x, self.w.router, self.top_k)
        d = self.comm.dispatch(x, ids, weights)
        # batched layout: rows [e, :n_e] of d.x are the tokens routed to local expert e (any rank's)
        out = torch.zeros(d.x.shape[0], d.x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        counts = d.expert_num_tokens.tolist()  # an engine's grouped GEMM would read it on the device
        for e, n in enumerate(counts):
            if n:
                out[e, :n] = expert_mlp(d.x[e, :n], self.w, self.first_expert + e).to(x.dtype)
        return self.comm.combine(out, d)  # weights applied here, accumulated in float32


def dense_reference(x: torch.Tensor, w: Weights, top_k: int) -> torch.Tensor:
    """The same layer without expert parallelism: every expert local, float32 throughout."""
    ids, weights = route(x, w.router, top_k)
    y = torch.zeros(x.shape[0], x.shape[1], device=x.device)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        y[rows] += weights[rows, slot].unsqueeze(1) * expert_mlp(x[rows], w, e)
    return y


def run(args: argparse.Namespace) -> float:
    """One rank's work; returns this rank's relative error against the dense reference."""
    topo = ep_comm.init_distributed()
    rank, world = topo.rank, topo.world_size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    experts = args.experts or 4 * world  # every rank owns experts / world of them
    cfg = ep_comm.EPConfig(num_experts=experts, top_k=args.topk, hidden=args.hidden,
                           max_tokens_per_rank=args.tokens, dtype=dtype, layout="batched", backend=args.backend)
    weights = Weights(args.hidden, args.ffn, experts, args.seed).to(device)
    # every rank's tokens from one seed (ranks get different token counts, one of them may have none)
    g = torch.Generator().manual_seed(args.seed + 1)
    counts = [args.tokens - (r % 3) * (args.tokens // 2) for r in range(world)]
    inputs = [torch.randn(max(0, n), args.hidden, generator=g).to(dtype) for n in counts]
    x = inputs[rank].to(device)

    with ep_comm.Communicator(cfg) as comm:
        layer = EPMoELayer(comm, weights, args.topk)
        y = layer.forward(x)

    ref = dense_reference(x, weights, args.topk)
    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12)) if ref.numel() else 0.0
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    print(f"rank {rank}/{world} backend {comm.backend}: {x.shape[0]} tokens, relative error vs dense {err:.2e} "
          f"({'ok' if err <= tol else 'MISMATCH'}, tol {tol:g})", flush=True)
    if err > tol:
        raise SystemExit(f"rank {rank}: MoE output differs from the dense reference (rel err {err:.3g} > {tol:g})")
    torch.distributed.destroy_process_group()
    return err


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=None,
                   help="spawn this many local ranks (ignored under torchrun/mpirun/srun; default: GPUs or 2)")
    p.add_argument("--tokens", type=int, default=16, help="max tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=None, help="a multiple of the number of ranks (default: 4 per rank)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run_or_spawn(run, (args,), args.nproc)
    if results is None:  # started by torchrun/mpirun/srun: this process was one rank
        return 0
    ok = all(r.ok for r in results)
    print("moe_layer example: " + ("OK, every rank matches the dense reference" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
