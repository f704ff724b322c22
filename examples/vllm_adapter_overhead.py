"""The vLLM adapter's own overhead: ``EPCommPrepareAndFinalize.prepare`` + ``finalize`` against the bare
``Communicator.dispatch`` + ``combine`` they wrap, in one run, on the same communicator.  Needs no vLLM.

    torchrun --nproc-per-node 2 examples/vllm_adapter_overhead.py --json overhead.json   # GPUs: mnnvl, nvshmem
    python examples/vllm_adapter_overhead.py --nproc 2 --json overhead.json               # spawns its ranks

For each backend x layout (standard <-> vLLM's ``Standard`` format, batched <-> ``BatchedExperts``) one
communicator and one adapter over it; for each mode (eager; on GPUs also CUDA graphs) the two paths are
timed alternately, one MoE layer call each, after a warm-up:

- raw: ``comm.dispatch(x, ids, w)`` then ``comm.combine(expert_out, d, out=output)``;
- adapter: ``pf.prepare(...)`` then ``pf.finalize(output, expert_out, ...)`` as vLLM's ``FusedMoEKernel``
  calls them (``expert_map`` passed, as vLLM does under expert parallelism).

No experts run in between: their output is a fixed tensor, so the difference is the adapter alone.  On
GPUs each call is timed with CUDA events (eager: the launches between the events; graph: one replay of
a graph holding the call); on CPUs with ``time.perf_counter``.  Ranks meet at a barrier before every
call.  Reported per row: the largest over ranks of each rank's median (and 90th percentile).  Prints a
markdown table; ``--json PATH`` also writes every number (per rank included) and the run's settings.

Where vLLM is not installed the adapter is imported over ``examples/vllm_stand_in`` (vLLM's base classes
only; the adapter's code is the same), and the output says which one ran.  Defaults: 128 tokens per rank,
hidden 7168, top-8 of 256 experts, bf16 on GPUs (mnnvl, nvshmem); a small layer on CPUs (naive, ag_rs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ep_comm
from ep_comm.cli.main import NVLS_OFF_DEFAULTS
from ep_comm.distributed.spawn import run_or_spawn

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PATHS = ("raw dispatch+combine", "adapter prepare+finalize")


def layer_inputs(args: argparse.Namespace, rank: int, device: torch.device):
    """This rank's ``(x [T, H], topk_ids [T, k] int32, topk_weights [T, k] float32)``: random activations,
    k distinct experts per token from random router logits (the same tokens every call)."""
    g = torch.Generator().manual_seed(args.seed + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(DTYPES[args.dtype])
    values, ids = torch.topk(torch.randn(args.tokens, args.experts, generator=g), args.topk, dim=-1)
    return x.to(device), ids.to(torch.int32).to(device), torch.softmax(values, dim=-1).to(device)


def measure(comm: ep_comm.Communicator, args: argparse.Namespace, barrier_group) -> dict:
    """``{mode: {path: [us per call]}}`` on this rank for one communicator."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )

    from ep_comm.integrations.vllm import EPCommPrepareAndFinalize

    cfg, dev, E, L = comm.cfg, comm.device, comm.cfg.num_experts, comm.num_local_experts
    x, ids, w = layer_inputs(args, comm.rank, dev)
    expert_map = torch.full((E,), -1, dtype=torch.int32, device=dev)
    expert_map[comm.rank * L:(comm.rank + 1) * L] = torch.arange(L, dtype=torch.int32, device=dev)
    pf = EPCommPrepareAndFinalize(comm)
    # batched experts leave the weighting to finalize; standard ones (vLLM's Triton/CPU experts) reduce
    impl = TopKWeightAndReduceDelegate() if cfg.layout == "batched" else TopKWeightAndReduceNoOP()
    d = comm.dispatch(x, ids, w)  # the received rows' shape: the experts' output has it
    expert_out = torch.randn(d.x.shape[:-1] + (cfg.hidden,)).to(dev, cfg.dtype)
    comm.combine(expert_out, d)
    output = torch.empty_like(x)

    def raw() -> None:
        comm.combine(expert_out, comm.dispatch(x, ids, w), out=output)

    def adapter() -> None:
        _, _, _, rids, rw = pf.prepare(x, w, ids, E, expert_map, False, None, False)
        pf.finalize(output, expert_out, rw, rids, False, impl)

    cuda = dev.type == "cuda"
    modes: dict[str, dict] = {"eager": {PATHS[0]: raw, PATHS[1]: adapter}}
    if cuda and "graph" in args.modes:
        graphs = {}
        for name, fn in modes["eager"].items():
            fn()  # eager first: the adapter reads expert_map once, which a capture cannot
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                fn()
            graphs[name] = g.replay
        modes["graph"] = graphs
    if "eager" not in args.modes:
        del modes["eager"]
    times: dict[str, dict[str, list[float]]] = {}
    for mode, steps in modes.items():
        times[mode] = {name: [] for name in steps}
        for it in range(args.warmup + args.iters):
            for name, fn in steps.items():  # alternated, so drift hits both paths alike
                if cuda:
                    torch.cuda.synchronize()
                dist.barrier(barrier_group)
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    us = start.elapsed_time(end) * 1e3
                else:
                    t0 = time.perf_counter()
                    fn()
                    us = (time.perf_counter() - t0) * 1e6
                if it >= args.warmup:
                    times[mode][name].append(us)
    comm.check_errors()
    return times


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[int(q * (len(s) - 1))]


def run(args: argparse.Namespace) -> dict | None:
    """One rank: every backend x layout x mode.  Returns the report on rank 0 (None elsewhere)."""
    for var, value in NVLS_OFF_DEFAULTS:  # multicast off unless the environment says otherwise
        os.environ.setdefault(var, value)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from vllm_stand_in import import_adapter

    which = import_adapter(stand_in=args.stand_in)
    topo = ep_comm.init_distributed()
    rank, world = topo.rank, topo.world_size
    barrier_group = dist.new_group(backend="gloo")  # a host-side meeting point, no device work
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for backend in args.backends:
        for layout in args.layouts:
            cfg = ep_comm.EPConfig(num_experts=args.experts, top_k=args.topk, hidden=args.hidden,
                                   max_tokens_per_rank=args.tokens, dtype=DTYPES[args.dtype], layout=layout,
                                   backend=backend, timeout_s=60.0)
            t0 = time.perf_counter()
            try:
                comm = ep_comm.Communicator(cfg, device=device)
            except (ep_comm.EPTopologyError, ep_comm.EPConfigError) as exc:
                rows.append({"backend": backend, "layout": layout, "skipped": f"{type(exc).__name__}: {exc}"})
                continue
            with comm:
                times = measure(comm, args, barrier_group)
            for mode, paths in times.items():
                mine = {p: {"p50": statistics.median(v), "p90": _p(v, 0.9)} for p, v in paths.items()}
                everyone: list = [None] * world
                dist.all_gather_object(everyone, mine, group=barrier_group)
                worst = {p: {q: max(r[p][q] for r in everyone) for q in ("p50", "p90")} for p in PATHS}
                rows.append({"backend": comm.backend, "layout": layout, "mode": mode, "us": worst,
                             "per_rank_us": everyone,
                             "overhead_us": worst[PATHS[1]]["p50"] - worst[PATHS[0]]["p50"],
                             "seconds": round(time.perf_counter() - t0, 2)})
    if rank != 0:
        return None
    return {
        "what": "ep_comm vLLM adapter (EPCommPrepareAndFinalize prepare+finalize) vs raw Communicator "
                "dispatch+combine, same communicator, same run",
        "vllm": which, "world_size": world, "device": _device_name(device), "torch": torch.__version__,
        "ep_comm": getattr(ep_comm, "__version__", "unknown"), "host": platform.node(),
        "settings": {k: getattr(args, k) for k in ("tokens", "hidden", "experts", "topk", "dtype", "warmup",
                                                   "iters", "seed")},
        "timer": "CUDA events" if device.type == "cuda" else "time.perf_counter",
        "statistic": "max over ranks of each rank's median (p50) / 90th percentile (p90), microseconds per call",
        "rows": rows,
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"


def table(report: dict) -> str:
    s = report["settings"]
    lines = [f"EP{report['world_size']} on {report['device']}, {s['tokens']} tokens/rank, hidden {s['hidden']}, "
             f"top-{s['topk']} of {s['experts']}, {s['dtype']}; {report['timer']}, {s['warmup']} warm-up + "
             f"{s['iters']} timed calls; {report['statistic']}; adapter over {report['vllm']}", "",
             "| backend | layout | mode | raw dispatch+combine p50 | adapter prepare+finalize p50 | overhead p50 "
             "| raw p90 | adapter p90 |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['backend']} | {r['layout']} | - | skipped: {r['skipped']} | | | | |")
            continue
        raw, ours = r["us"][PATHS[0]], r["us"][PATHS[1]]
        pct = (ours["p50"] / raw["p50"] - 1) * 100 if raw["p50"] > 0 else float("nan")
        lines.append(f"| {r['backend']} | {r['layout']} | {r['mode']} | {raw['p50']:.1f} us | {ours['p50']:.1f} us "
                     f"| {r['overhead_us']:+.1f} us ({pct:+.1f}%) | {raw['p90']:.1f} us | {ours['p90']:.1f} us |")
    return "\n".join(lines)


def finish(report: dict, args: argparse.Namespace) -> None:
    print(table(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", flush=True)


def rank_main(args: argparse.Namespace) -> None:
    """Under torchrun: rank 0 prints and writes."""
    t0 = time.perf_counter()
    report = run(args)
    if report is not None:
        finish(report, args)
        print(f"total {time.perf_counter() - t0:.1f} s (this rank, from its start)", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=None, help="spawn this many local ranks (not under torchrun; "
                   "default: one per GPU, else 2)")
    p.add_argument("--backends", nargs="+", default=None, help="default mnnvl nvshmem on GPUs, naive ag_rs on CPUs")
    p.add_argument("--layouts", nargs="+", choices=("standard", "batched"), default=["standard", "batched"])
    p.add_argument("--modes", nargs="+", choices=("eager", "graph"), default=["eager", "graph"],
                   help="graph only on GPUs")
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank (= max_tokens_per_rank)")
    p.add_argument("--hidden", type=int, default=None, help="default 7168 on GPUs, 256 on CPUs")
    p.add_argument("--experts", type=int, default=None, help="default 256 on GPUs, 8 on CPUs")
    p.add_argument("--topk", type=int, default=None, help="default 8 on GPUs, 2 on CPUs")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stand-in", action="store_true", help="use the vLLM stand-in even where vLLM is installed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report here")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    args.backends = args.backends or (["mnnvl", "nvshmem"] if gpu else ["naive", "ag_rs"])
    args.hidden = args.hidden or (7168 if gpu else 256)
    args.experts = args.experts or (256 if gpu else 8)
    args.topk = args.topk or (8 if gpu else 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    results = run_or_spawn(run, (args,), args.nproc, timeout_s=600, launched=rank_main)
    if results is None:  # started by torchrun/mpirun/srun: this process was one rank
        return 0
    if not all(r.ok for r in results):
        return 1
    finish(results[0].value, args)
    print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
