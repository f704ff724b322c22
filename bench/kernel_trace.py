"""Where the time of one mnnvl dispatch / combine goes, from stamps the kernels write themselves.

    python3 bench/kernel_trace.py --nproc 2 --tokens 128 4096 --layout standard batched

With ``EP_COMM_TRACE=1`` every block of the mnnvl kernels writes the GPU's globaltimer when it
reaches each phase (protocol.h, ``kTr*``): start, its sends done, the grid-wide arrival, the peers'
flags released (last block), per source the flag seen, every source's rows laid out, end.  This script
captures dispatch and combine in CUDA graphs like ``ep-comm bench --mode graph``, replays each
after lining the ranks up on the device, and prints per rank the median over ``--iters`` replays of
each phase's time from the kernel's first block start (max over blocks), next to the CUDA-event
time of the replay (ranks aligned and launch gap hidden as in the bench: ``launcher.align_devices``).
A dispatch that receives while it sends also gives the peer rows its receiving warps had laid out
when the sends ended ("rows by sent", over all blocks) and how long each of those warps had waited
for rows to land by then ("wait/warp by sent", µs).
The stamps add block barriers, so the kernels run slightly slower than in the bench; the split is
what matters.  Timers of different GPUs are not synchronised: compare phases within a rank.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ep_comm  # noqa: E402
from ep_comm import oracle  # noqa: E402
from ep_comm.backends.one_sided.device import TRACE_ENV  # noqa: E402
from ep_comm.backends.one_sided.layout import receive_warps  # noqa: E402
from ep_comm.backends.protocol import Stamp, Trace  # noqa: E402
from ep_comm.cli.launcher import _SPAWNED_ENV, align_devices, gather_objects, host_barrier, setup_rank  # noqa: E402
from ep_comm.distributed.spawn import raise_on_failure, spawn_local  # noqa: E402


def _phases(stamps: torch.Tensor, op: int, world: int, receiving_warps: int) -> dict[str, float]:
    """µs from the first block's start to each phase (max over the blocks that stamped it);
    ``receiving_warps``: per block, the warps that received while the others sent."""
    blocks = stamps.view(2, -1, Trace.SLOTS)[op].double()
    t0 = blocks[:, Stamp.START].min()
    names = {Stamp.SENT: "sent", Stamp.ARRIVED: "arrived", Stamp.SIGNALLED: "signalled", Stamp.END: "end"}
    if op == Trace.DISPATCH:
        for i in range(min(world, Trace.SOURCES)):
            names[Stamp.SOURCE0 + 2 * i] = f"src+{i} flag"
        names[Stamp.SOURCE0 + 1] = "rows laid out"
    else:
        names[Stamp.SOURCE0] = "flags seen"
    out = {"start spread": float((blocks[:, Stamp.START].max() - t0) / 1e3)}
    sent = blocks[:, Stamp.SENT]
    if (sent > 0).any():  # the first block done sending: with "sent" (the last), the blocks' imbalance
        out["sent (first block)"] = float((sent[sent > 0].min() - t0) / 1e3)
    for slot, name in names.items():
        col = blocks[:, slot]
        col = col[col > 0]
        if col.numel():
            out[name] = float((col.max() - t0) / 1e3)
    if op == Trace.DISPATCH and (blocks[:, Stamp.ROWS_BY_SENT] > 0).any():  # receiving while sending
        out["rows by sent"] = float(blocks[:, Stamp.ROWS_BY_SENT].sum())
        warps = blocks.shape[0] * receiving_warps
        out["wait/warp by sent"] = float(blocks[:, Stamp.WAITED_BY_SENT].sum() / warps / 1e3)
    return out


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = rows[0].keys()
    return {k: sorted(r[k] for r in rows if k in r)[len(rows) // 2] for k in keys}


def _one_shape(env, args, layout: str, tokens: int) -> dict:
    cfg = ep_comm.EPConfig(num_experts=args.experts, top_k=args.topk, hidden=args.hidden,
                           max_tokens_per_rank=tokens, dtype=torch.bfloat16, layout=layout, backend="mnnvl",
                           quant=args.quant, num_sms=args.num_sms, zero_copy=args.zero_copy and layout == "standard")
    comm = ep_comm.Communicator(cfg)
    kernels = comm._impl.kernels
    if kernels.trace is None:
        raise RuntimeError(f"{TRACE_ENV}=1 did not reach the backend")
    inp = oracle.random_inputs(cfg, env.world_size, seed=7, tokens=[tokens] * env.world_size)[env.rank].to(env.device)
    x = inp.x
    if cfg.zero_copy:  # x and the expert outputs where the zero-copy calls read them in place
        x = comm.dispatch_input_buffer()[:tokens]
        x.copy_(inp.x)
    gs = inp.x_scales  # NVFP4: the global scale of all ranks' x (oracle.random_inputs); otherwise None
    d = comm.dispatch(x, inp.topk_ids, inp.topk_weights, gs)  # warm-up, and the shapes
    eo = torch.randn((*d.x.shape[:-1], cfg.hidden), dtype=cfg.dtype, device=env.device) if layout == "standard" \
        else torch.zeros((*d.x.shape[:-1], cfg.hidden), dtype=cfg.dtype, device=env.device)
    if cfg.zero_copy:
        eo = comm.expert_output_buffer(d).copy_(eo)
    out = torch.empty((tokens, cfg.hidden), dtype=cfg.dtype, device=env.device)
    comm.combine(eo, d, out=out)
    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(gd, stream=stream):
            dg = comm.dispatch(x, inp.topk_ids, inp.topk_weights, gs)
        with torch.cuda.graph(gc, stream=stream):
            comm.combine(eo, dg, out=out)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    rows: dict[str, list] = {"dispatch": [], "combine": []}
    receiving = receive_warps(cfg, env.world_size)  # per block, while the others send
    for it in range(args.warmup + args.iters):
        host_barrier(env, hide_launch=True)  # like the bench: replays launched while the GPU is busy
        ev[0].record()
        gd.replay()
        ev[1].record()
        align_devices(env, hide_launch=True)
        ev[2].record()
        gc.replay()
        ev[3].record()
        torch.cuda.synchronize()
        if it < args.warmup:
            continue
        stamps = kernels.trace.cpu()
        for name, op, (a, b) in (("dispatch", Trace.DISPATCH, (0, 1)), ("combine", Trace.COMBINE, (2, 3))):
            ph = _phases(stamps, op, env.world_size, receiving)
            ph["event"] = ev[a].elapsed_time(ev[b]) * 1e3
            rows[name].append(ph)
    comm.check_errors()
    comm.close()
    del gd, gc, dg, d, eo
    torch.cuda.empty_cache()
    return {op: _median(r) for op, r in rows.items()}


def rank_main(args: argparse.Namespace) -> dict:
    os.environ[TRACE_ENV] = "1"
    env = setup_rank(300.0)
    results = {}
    for layout in args.layout:
        for tokens in args.tokens:
            results[(layout, tokens)] = _one_shape(env, args, layout, tokens)
    everyone = gather_objects(env, results)
    dist.destroy_process_group()
    return {"ranks": everyone} if env.rank == 0 else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    p.add_argument("--tokens", type=int, nargs="+", default=[128])
    p.add_argument("--layout", nargs="+", default=["standard", "batched"])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--quant", default=None, choices=[None, "fp8", "nvfp4"])
    p.add_argument("--num-sms", type=int, default=None)
    p.add_argument("--zero-copy", action="store_true",
                   help="standard layout with EPConfig.zero_copy, x in dispatch_input_buffer, expert outputs in "
                        "expert_output_buffer")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    res = raise_on_failure(spawn_local(rank_main, args.nproc, (args,), timeout_s=600,
                                     extra_env=lambda r: {_SPAWNED_ENV: str(args.nproc)}))[0]["ranks"]
    for (layout, tokens) in res[0]:
        for op in ("dispatch", "combine"):
            print(f"{op} {layout} {tokens} tok (µs from the kernel's first block start, median of {args.iters}, "
                  f"max over blocks)")
            keys = list(res[0][(layout, tokens)][op])
            print("  " + " | ".join(f"{k:>10s}" for k in ["rank"] + keys))
            for r, per_rank in enumerate(res):
                vals = per_rank[(layout, tokens)][op]
                print("  " + " | ".join([f"{r:>10d}"] + [f"{vals.get(k, float('nan')):10.1f}" for k in keys]))



if __name__ == "__main__":
    main()
