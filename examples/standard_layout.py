"""The standard layout: one received row per (token, this rank), with local expert ids and weights.

    torchrun --nproc-per-node 2 examples/standard_layout.py
    python examples/standard_layout.py --nproc 2

What a fused-MoE kernel (vLLM/SGLang style) does with ``layout="standard"``: for each received row,
run the row's *local* experts (``d.topk_ids`` in ``[0, L)``, -1 = expert on another rank or padding),
weight them with ``d.topk_weights`` and sum.  ``combine`` then adds the rows of every rank the token
went to.  Rows whose ids are all -1 are padding; combine ignores whatever they hold.

The tokens go into ``comm.dispatch_input_buffer()`` and the expert outputs into
``comm.expert_output_buffer(d)``: with ``--zero-copy`` on the kernel backends (GPUs on NVLink) those
are the communicator's own buffer, so dispatch sends x from where it lies and (from 512 tokens per
rank) combine reads the expert outputs in place; everywhere else they are plain tensors, so the code
is the same.
"""
from __future__ import annotations

import argparse
import sys

import torch

import ep_comm
from ep_comm.distributed.spawn import run_or_spawn


def expert(x: torch.Tensor, w: torch.Tensor, e: int) -> torch.Tensor:
    """Expert ``e``: a tanh-activated linear map, in float32."""
    return torch.tanh(x.float() @ w[e])


def run(args: argparse.Namespace) -> float:
    topo = ep_comm.init_distributed()
    rank, world = topo.rank, topo.world_size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cfg = ep_comm.EPConfig(num_experts=args.experts, top_k=args.topk, hidden=args.hidden,
                           max_tokens_per_rank=args.tokens, dtype=torch.bfloat16, layout="standard",
                           zero_copy=args.zero_copy)
    g = torch.Generator().manual_seed(args.seed)  # same weights and inputs on every rank
    w = (torch.randn(args.experts, args.hidden, args.hidden, generator=g) / args.hidden**0.5).to(device)
    xs = [torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    logits = [torch.randn(args.tokens, args.experts, generator=g) for _ in range(world)]
    x, lg = xs[rank].to(device), logits[rank].to(device)
    vals, ids = ep_comm.routing.topk(lg, args.topk)
    weights = torch.softmax(vals, dim=-1)

    with ep_comm.Communicator(cfg) as comm:
        x_in = comm.dispatch_input_buffer()[: x.shape[0]]  # the layer before would write its output here
        x_in.copy_(x)
        d = comm.dispatch(x_in, ids, weights)
        first = rank * comm.num_local_experts
        out = torch.zeros(d.x.shape[0], args.hidden, device=device)  # float32 accumulation per row
        for e in range(comm.num_local_experts):
            rows, slot = torch.nonzero(d.topk_ids == e, as_tuple=True)
            if rows.numel():
                out[rows] += d.topk_weights[rows, slot].unsqueeze(1) * expert(d.x[rows], w, first + e)
        padding = int((d.topk_ids < 0).all(dim=1).sum())  # (zero copy: d's rows are read before combine)
        buf = comm.expert_output_buffer(d)  # a fused-MoE kernel would write its output here directly
        buf.copy_(out)
        y = comm.combine(buf, d)  # sums this token's rows from every rank it went to

    ref = torch.zeros(x.shape[0], args.hidden, device=device)
    for j in range(args.topk):
        for e in torch.unique(ids[:, j]).tolist():
            rows = torch.nonzero(ids[:, j] == e).flatten()
            ref[rows] += weights[rows, j].unsqueeze(1) * expert(x[rows], w, e)
    err = float((y.float() - ref).norm() / ref.norm().clamp_min(1e-12))
    print(f"rank {rank}/{world}: received {d.x.shape[0]} rows ({padding} padding), relative error {err:.2e}",
          flush=True)
    if err > 2e-2:  # bf16 rounding of the row sums and of the output
        raise SystemExit(f"rank {rank}: combine output differs from the reference (rel err {err:.3g})")
    torch.distributed.destroy_process_group()
    return err


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=None, help="local ranks to spawn (ignored under a launcher)")
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zero-copy", action="store_true", help="EPConfig.zero_copy: received rows and expert outputs "
                   "stay in the communicator's buffer (kernel backends)")
    args = p.parse_args(argv)
    results = run_or_spawn(run, (args,), args.nproc)
    if results is None:  # started by torchrun/mpirun/srun: this process was one rank
        return 0
    ok = all(r.ok for r in results)
    print("standard_layout example: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
