"""``ep-comm bench``: dispatch/combine latency and bandwidth per backend × layout (docs/design.md §17).

For every token count, backend and layout:

1. one communicator is created (``max_tokens_per_rank`` = the token count, so capacities are real);
2. its output is checked once against ``ep_comm.oracle`` on a slice of at most ``--check-tokens``
   tokens per rank (and, in graph mode, graph replays are checked against the eager result), so a fast
   but wrong backend is reported as a failure instead of being timed;
3. dispatch and combine are timed separately, after ``--warmup`` untimed pairs, over ``--sets`` run
   sets with fresh random routing each (``oracle.random_inputs`` with a new seed per set).  Ranks are
   lined up on the host before every timed pair.  CUDA events on GPUs, ``perf_counter`` on CPUs.

Reported per op: the max over ranks of each rank's median (p50) and 90th percentile (p90), the
algorithmic bandwidth and the same-run ``all_to_all_single`` baseline (NCCL on GPUs, gloo on CPUs)
with per-peer chunks of ``tokens × hidden`` elements of ``--dtype``.
"""
from __future__ import annotations

import argparse
import sys
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import time
import traceback
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import oracle
from ..communicator import Communicator
from ..config import EPConfig
from ..errors import EPConfigError, EPError, EPTopologyError
from ..layouts import Dispatched
from . import DTYPES, default_backends, format_table, resolve_backend_request
from .launcher import RankEnv, agree_exit_code, gather_objects, host_barrier, say, setup_rank, teardown

FP8_SCALE_BLOCK = 128  # channels per fp8 scale (docs/design.md §5); a float32 scale rides with each block


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[128], metavar="T",
                   help="tokens per rank; several values run one after the other (default: 128)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default: 7168, DeepSeek-V3)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default: 8)")
    p.add_argument("--experts", type=int, default=256, help="global experts (default: 256)")
    p.add_argument("--routing", choices=("uniform", "skewed"), default="uniform",
                   help="uniform: k distinct random experts per token; skewed: every token's first choice is "
                        "one hot expert (default: uniform)")
    p.add_argument("--backend", nargs="+", default=None, metavar="NAME",
                   help="backend(s), comma or space separated, 'auto', or 'all' (every usable built backend; the "
                        "default, or 'auto' when $EP_COMM_BACKEND is set)")
    p.add_argument("--layout", choices=("standard", "batched", "both"), default="both", help="(default: both)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype (default: bf16)")
    p.add_argument("--quant", choices=("none", "fp8"), default="none",
                   help="fp8: dispatch sends e4m3 + per-128-channel scales (default: none)")
    p.add_argument("--iters", type=int, default=50, help="timed dispatch+combine pairs per config (default: 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed pairs first (default: 10)")
    p.add_argument("--sets", type=int, default=5, help="run sets with fresh random routing (default: 5)")
    p.add_argument("--mode", choices=("eager", "graph"), default="eager",
                   help="eager (default), or graph: time replays of CUDA graphs of dispatch and of combine "
                        "(CUDA only)")
    p.add_argument("--check-tokens", type=int, default=64,
                   help="tokens per rank of the oracle check before timing (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the random inputs (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write the JSON report (docs/design.md §17) here")
    p.add_argument("--plot", metavar="PATH", help="PNG of p50 latency vs tokens (needs matplotlib)")
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)  # tests: wrong combine


def check_arguments(args: argparse.Namespace) -> Optional[str]:
    """Problems found before any rank starts (so a typo costs no spawn)."""
    args.backend = default_backends(args.backend)
    names, _, err = resolve_backend_request(args.backend)
    if err:
        return err
    args.backends = names
    if any(t < 1 for t in args.tokens):
        return f"--tokens must be >= 1, got {args.tokens}"
    for flag in ("iters", "sets", "check_tokens"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be >= 1"
    if args.warmup < 0:
        return "--warmup must be >= 0"
    args.sets = min(args.sets, args.iters)  # every set gets at least one timed pair
    if args.mode == "graph" and not torch.cuda.is_available():
        return "--mode graph captures CUDA graphs and needs CUDA GPUs; this machine has none (use --mode eager)"
    try:
        _config(args, max(args.tokens), "standard", "naive")
    except EPConfigError as exc:
        return str(exc)
    return None


def _config(args: argparse.Namespace, tokens: int, layout: str, backend: str) -> EPConfig:
    return EPConfig(num_experts=args.experts, top_k=args.topk, hidden=args.hidden, max_tokens_per_rank=tokens,
                    dtype=DTYPES[args.dtype], layout=layout, backend=backend,
                    quant=None if args.quant == "none" else args.quant, timeout_s=args.op_timeout)


# -- measurement helpers ------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunSet:
    """One rank's inputs for a run set and the bytes they move (for the algorithmic GB/s)."""

    inp: oracle.RankInput  # on the device
    remote_sends: int  # Σ over this rank's tokens of distinct remote destination ranks


def _remote_sends(ids: torch.Tensor, rank: int, world: int, num_experts: int) -> int:
    """Σ over tokens of the distinct ranks (other than ``rank``) that own one of the token's experts."""
    if ids.numel() == 0:
        return 0
    per_rank = num_experts // world
    valid = ids >= 0
    # -1 slots go to a spare column, so they cannot overwrite a real destination's mark
    dest = torch.where(valid, ids.long() // per_rank, torch.full_like(ids, world, dtype=torch.long))
    hit = torch.zeros(ids.shape[0], world + 1, dtype=torch.bool)
    hit.scatter_(1, dest, True)
    hit[:, rank] = False
    return int(hit[:, :world].sum())


def _make_sets(env: RankEnv, args: argparse.Namespace, tokens: int) -> list[RunSet]:
    """Fresh routing per set; identical on every rank (the oracle seeds all ranks' inputs alike)."""
    cfg = _config(args, tokens, "standard", "naive")
    out = []
    for s in range(args.sets):
        seed = (args.seed * 1_000_003 + tokens * 7919 + s) % (2**62)
        mine = oracle.random_inputs(cfg, env.world_size, seed, tokens=[tokens] * env.world_size,
                                    routing=args.routing)[env.rank]
        out.append(RunSet(mine.to(env.device), _remote_sends(mine.topk_ids, env.rank, env.world_size, args.experts)))
    return out


class _Timer:
    """Times consecutive sections of one iteration: CUDA events on GPUs, perf_counter on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[list[Any]] = []

    def stamp(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, stamps: list[Any]) -> None:
        self.pending.append(stamps)

    def sections_us(self) -> list[list[float]]:
        """Per section, the list of durations in µs (syncs the device once)."""
        if self.cuda:
            torch.cuda.synchronize()
            durations = [[a.elapsed_time(b) * 1e3 for a, b in zip(s, s[1:])] for s in self.pending]
        else:
            durations = [[(b - a) * 1e6 for a, b in zip(s, s[1:])] for s in self.pending]
        return [list(col) for col in zip(*durations)] if durations else []


def _percentiles(samples: list[float]) -> tuple[float, float]:
    return float(np.percentile(samples, 50)), float(np.percentile(samples, 90))


def _expert_outputs(cfg: EPConfig, rank: int, world: int, d: Dispatched) -> torch.Tensor:
    """Oracle test experts applied to ``d`` (padding poisoned with NaN: combine must ignore it).

    Batched: filled per expert in ``cfg.dtype`` instead of ``oracle.run_experts``' float32 copy of the
    whole ``[L, capacity, hidden]`` buffer, which at prefill shapes would need tens of GB.
    """
    if d.layout != "batched":
        return oracle.run_experts(cfg, rank, world, d)
    num_local = cfg.num_experts // world
    out = torch.full((num_local, d.x.shape[1], cfg.hidden), float("nan"), dtype=cfg.dtype, device=d.x.device)
    for e, n in enumerate(d.expert_num_tokens.tolist()):
        if n:
            s = None if d.x_scales is None else d.x_scales[e, :n]
            xf = oracle.payload_as_float(cfg, d.x[e, :n], s)
            out[e, :n] = oracle.test_expert(xf, rank * num_local + e).to(cfg.dtype)
    return out


def _trimmed(d: Dispatched) -> Dispatched:
    """``d`` with the batched buffers cut to the longest expert (the oracle copies them to the host)."""
    if d.layout != "batched":
        return d
    longest = int(d.expert_num_tokens.max()) if d.expert_num_tokens.numel() else 0
    s = None if d.x_scales is None else d.x_scales[:, :longest]
    return dataclasses.replace(d, x=d.x[:, :longest], x_scales=s)


def _sanity_check(env: RankEnv, cfg: EPConfig, comm: Communicator, args: argparse.Namespace) -> list[str]:
    """Oracle check of one dispatch+combine on the communicator about to be timed (all ranks' problems)."""
    tokens = min(cfg.max_tokens_per_rank, args.check_tokens)
    inputs = oracle.random_inputs(cfg, env.world_size, seed=args.seed + 424242, tokens=[tokens] * env.world_size,
                                  routing=args.routing)
    problems: list[str] = []
    try:
        expected_d = oracle.expected_dispatch(cfg, inputs)[env.rank]
        expected_y = oracle.expected_combine(cfg, [inputs[env.rank]])[0]  # a rank's y needs only its inputs
        mine = inputs[env.rank].to(env.device)
        d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights, mine.x_scales)
        problems += [f"dispatch: {p}" for p in oracle.compare_dispatch(cfg, _trimmed(d), expected_d)]
        y = comm.combine(_expert_outputs(cfg, env.rank, env.world_size, d), d)
        if args.inject_fault and env.rank == env.world_size - 1 and y.shape[0]:
            y[0] += 1.0  # deliberately wrong: proves a wrong backend is caught, not timed
        problems += [f"combine: {p}" for p in oracle.compare_combine(cfg, y, expected_y)]
    except EPError as exc:  # typed library errors are findings; anything else is a crash worth a traceback
        problems.append(f"{type(exc).__name__}: {exc}")
    return [f"rank {r}: {p}" for r, ps in enumerate(gather_objects(env, problems)) for p in ps]


def _expert_buffer(cache: dict, cfg: EPConfig, d: Dispatched, device: torch.device) -> torch.Tensor:
    """A reusable expert-output tensor shaped for ``combine(·, d)`` (content does not affect timing)."""
    shape = (d.x.shape[0], d.x.shape[1], cfg.hidden) if d.layout == "batched" else (d.x.shape[0], cfg.hidden)
    buf = cache.get(shape)
    if buf is None:
        buf = cache[shape] = torch.zeros(shape, dtype=cfg.dtype, device=device)
    return buf


def _split_iters(args: argparse.Namespace) -> list[int]:
    return [args.iters // args.sets + (1 if s < args.iters % args.sets else 0) for s in range(args.sets)]


def _time_eager(env: RankEnv, cfg: EPConfig, comm: Communicator, sets: list[RunSet],
                args: argparse.Namespace) -> tuple[list[float], list[float]]:
    cache: dict = {}

    def pair(inp: oracle.RankInput) -> None:
        d = comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights, inp.x_scales)
        comm.combine(_expert_buffer(cache, cfg, d, env.device), d)

    for _ in range(args.warmup):
        pair(sets[0].inp)
    timer = _Timer(env.device)
    for rs, n in zip(sets, _split_iters(args)):
        inp = rs.inp
        for _ in range(n):
            host_barrier(env)
            t0 = timer.stamp()
            d = comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights, inp.x_scales)
            t1 = timer.stamp()
            comm.combine(_expert_buffer(cache, cfg, d, env.device), d)
            t2 = timer.stamp()
            timer.add([t0, t1, t2])
    disp, comb = timer.sections_us()
    return disp, comb


def _time_graph(env: RankEnv, cfg: EPConfig, comm: Communicator, sets: list[RunSet],
                args: argparse.Namespace) -> tuple[Optional[tuple[list[float], list[float]]], list[str]]:
    """Capture dispatch and combine as two CUDA graphs, check a replay, then time replays."""
    first = sets[0].inp
    x_s, ids_s, w_s = first.x.clone(), first.topk_ids.clone(), first.topk_weights.clone()
    # eager reference on the same inputs (the eager path is the one the oracle check covered)
    d = comm.dispatch(x_s, ids_s, w_s)
    y_ref = comm.combine(_expert_outputs(cfg, env.rank, env.world_size, d), d).clone()
    cache: dict = {}
    for _ in range(args.warmup):
        d = comm.dispatch(x_s, ids_s, w_s)
        comm.combine(_expert_buffer(cache, cfg, d, env.device), d)
    host_barrier(env)
    g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    # thread_local: the NCCL watchdog thread may query events of earlier eager work mid-capture
    with torch.cuda.graph(g_dispatch, capture_error_mode="thread_local"):
        d_s = comm.dispatch(x_s, ids_s, w_s)
    eo_s = torch.zeros_like(_expert_buffer(cache, cfg, d_s, env.device))
    with torch.cuda.graph(g_combine, capture_error_mode="thread_local"):
        y_s = comm.combine(eo_s, d_s)

    host_barrier(env)
    g_dispatch.replay()
    eo_s.copy_(_expert_outputs(cfg, env.rank, env.world_size, d_s))
    g_combine.replay()
    problems: list[str] = []
    try:
        comm.check_errors()
        problems += [f"graph replay vs eager: {p}" for p in oracle.compare_combine(cfg, y_s, y_ref.float())]
    except EPError as exc:
        problems.append(f"graph replay: {type(exc).__name__}: {exc}")
    problems = [f"rank {r}: {p}" for r, ps in enumerate(gather_objects(env, problems)) for p in ps]
    if problems:
        return None, problems

    timer = _Timer(env.device)
    for rs, n in zip(sets, _split_iters(args)):
        x_s.copy_(rs.inp.x)  # new routing and data into the graphs' static inputs
        ids_s.copy_(rs.inp.topk_ids)
        w_s.copy_(rs.inp.topk_weights)
        for _ in range(n):
            host_barrier(env)
            t0 = timer.stamp()
            g_dispatch.replay()
            t1 = timer.stamp()
            g_combine.replay()
            t2 = timer.stamp()
            timer.add([t0, t1, t2])
    disp, comb = timer.sections_us()
    comm.check_errors()
    return (disp, comb), []


def _time_baseline(env: RankEnv, args: argparse.Namespace, tokens: int) -> tuple[float, float, str]:
    """``all_to_all_single`` with ``tokens × hidden`` elements per peer: (max-over-ranks p50, p90, mode)."""
    dtype = DTYPES[args.dtype]
    send = torch.randn(env.world_size * tokens * args.hidden, device=env.device).to(dtype)
    recv = torch.empty_like(send)
    for _ in range(max(1, args.warmup)):
        dist.all_to_all_single(recv, send)
    run, mode = (lambda: dist.all_to_all_single(recv, send)), "eager"
    if args.mode == "graph":
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                dist.all_to_all_single(recv, send)
            run, mode = graph.replay, "graph"
        except Exception:  # noqa: BLE001 - an uncapturable baseline is timed eagerly, and says so
            pass
    timer = _Timer(env.device)
    for _ in range(args.iters):
        host_barrier(env)
        t0 = timer.stamp()
        run()
        timer.add([t0, timer.stamp()])
    (samples,) = timer.sections_us()
    stats = gather_objects(env, _percentiles(samples))
    return max(s[0] for s in stats), max(s[1] for s in stats), mode


# -- the worker -------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    env = setup_rank(max(300.0, 3 * args.op_timeout))
    try:
        code = agree_exit_code(env, _bench(env, args))
    except BaseException:
        # show the error now: with NCCL, destroying a process group after a failed collective or
        # capture can block forever, which would hide it
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        if env.device.type == "cuda":
            os._exit(3)
        raise
    teardown()
    return code


def _bench(env: RankEnv, args: argparse.Namespace) -> int:
    world = env.world_size
    if args.experts % world:
        say(env, f"error: --experts {args.experts} is not divisible by the world size {world}")
        return 2
    layouts = ["standard", "batched"] if args.layout == "both" else [args.layout]
    names, explicit, _ = resolve_backend_request(args.backend)
    baseline_backend = "nccl" if env.device.type == "cuda" else "gloo"
    say(env, f"ep-comm bench: {world} ranks on {_device_name(env)} ({env.launcher}), hidden {args.hidden}, "
             f"top-{args.topk} of {args.experts} experts, {args.dtype}, quant {args.quant}, {args.routing} routing, "
             f"{args.mode} mode, {args.iters} iters in {args.sets} sets after {args.warmup} warm-up")
    results: list[dict] = []
    failures: list[dict] = []
    notes: list[str] = []
    for tokens in args.tokens:
        say(env, f"  [{tokens} tok] all_to_all_single baseline ({args.mode})", file=sys.stderr)
        base_p50, base_p90, base_mode = _time_baseline(env, args, tokens)
        sets = _make_sets(env, args, tokens)
        for name in names:
            for layout in layouts:
                cfg = _config(args, tokens, layout, name)
                try:
                    comm = Communicator(cfg)
                except (EPTopologyError, EPConfigError) as exc:  # raised alike on every rank
                    if explicit:
                        failures.append(_failure(name, layout, tokens, [f"cannot create: {exc}"]))
                    elif not any(n.startswith(f"{name}:") for n in notes):
                        notes.append(f"{name}: skipped, not usable here ({exc})")
                    continue
                with comm:
                    say(env, f"  [{tokens} tok] {comm.backend}/{layout}: oracle check, then {args.mode} timing",
                        file=sys.stderr)
                    problems = _sanity_check(env, cfg, comm, args)
                    timed = None
                    if not problems:
                        if args.mode == "graph":
                            timed, problems = _time_graph(env, cfg, comm, sets, args)
                        else:
                            timed = _time_eager(env, cfg, comm, sets, args)
                    resolved, sms = comm.backend, _sms_used(comm)
                if problems or timed is None:
                    failures.append(_failure(resolved, layout, tokens, problems))
                    say(env, f"FAILED oracle check: backend {resolved}, layout {layout}, tokens {tokens}; not timed")
                    for p in problems[:10]:
                        say(env, f"  {p}")
                    continue
                local = [_percentiles(timed[0]), _percentiles(timed[1])]
                stats = gather_objects(env, (local, sum(rs.remote_sends for rs in sets) / len(sets)))
                for i, op in enumerate(("dispatch", "combine")):
                    p50 = max(s[0][i][0] for s in stats)
                    p90 = max(s[0][i][1] for s in stats)
                    per_token = _dispatch_bytes_per_token(cfg) if op == "dispatch" else cfg.hidden * cfg.dtype.itemsize
                    mean_bytes = sum(s[1] for s in stats) / world * per_token
                    results.append({
                        "backend": resolved, "op": op, "layout": layout, "tokens": tokens, "hidden": args.hidden,
                        "top_k": args.topk, "experts": args.experts, "dtype": args.dtype,
                        "p50_us": round(p50, 3), "p90_us": round(p90, 3),
                        "gbps": _sig(mean_bytes / (p50 * 1e-6) / 1e9) if p50 > 0 else None,
                        "sms": sms, "baseline_nccl_us": round(base_p50, 3),
                        "ratio": round(p50 / base_p50, 3) if base_p50 > 0 else None,
                        "baseline_p90_us": round(base_p90, 3), "baseline_backend": baseline_backend,
                        "baseline_mode": base_mode, "mode": args.mode, "routing": args.routing,
                        "quant": args.quant, "world_size": world,
                    })
    if env.is_root:
        _report(env, args, results, failures, notes, baseline_backend)
    return 1 if failures or not results else 0


def _sig(value: float, digits: int = 4) -> float:
    """Round to significant digits (CPU bandwidths are tiny; fixed decimals would print 0)."""
    return float(f"{value:.{digits}g}")


def _failure(backend: str, layout: str, tokens: int, problems: list[str]) -> dict:
    return {"backend": backend, "layout": layout, "tokens": tokens, "problems": problems}


def _dispatch_bytes_per_token(cfg: EPConfig) -> int:
    """What one token puts on the wire in dispatch: fp8 payload + its scales, or hidden × dtype."""
    if cfg.quant == "fp8":
        return cfg.hidden + (cfg.hidden // FP8_SCALE_BLOCK) * 4
    return cfg.hidden * cfg.dtype.itemsize


def _sms_used(comm: Communicator) -> Optional[int]:
    """SMs a kernel backend reports (attribute ``num_sms``); None for collective backends."""
    for obj in (comm, getattr(comm, "_impl", None)):
        value = getattr(obj, "num_sms", None)
        if isinstance(value, int):
            return value
    return None


# -- output -------------------------------------------------------------------------------------------------
def _device_name(env: RankEnv) -> str:
    if env.device.type == "cuda":
        return torch.cuda.get_device_name(env.device)
    return f"cpu ({platform.machine() or 'unknown'}, gloo)"


def _git_commit() -> tuple[str, Optional[bool]]:
    """Commit of the checkout ep_comm runs from (and whether tracked files differ from it)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode:
            return os.environ.get("EP_COMM_GIT_COMMIT", "unknown"), None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("EP_COMM_GIT_COMMIT", "unknown"), None


def _report(env: RankEnv, args: argparse.Namespace, results: list[dict], failures: list[dict],
            notes: list[str], baseline_backend: str) -> None:
    rows = [[r["backend"], r["layout"], r["op"], r["tokens"], f"{r['p50_us']:.1f}", f"{r['p90_us']:.1f}",
             "-" if r["gbps"] is None else f"{r['gbps']:.3g}", r["sms"], f"{r['baseline_nccl_us']:.1f}",
             "-" if r["ratio"] is None else f"{r['ratio']:.2f}"] for r in results]
    headers = ["backend", "layout", "op", "tokens", "p50_us", "p90_us", "GB/s", "SMs",
               f"{baseline_backend}_a2a_us", "ratio"]
    print(format_table(headers, rows, right=range(3, 10)) if rows else "(no results)", flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)
    if failures:
        print(f"{len(failures)} config(s) FAILED the oracle check and were not timed", flush=True)
    if args.json:
        commit, dirty = _git_commit()
        doc = {
            "device": _device_name(env), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "git_commit": commit, "world_size": env.world_size, "results": results,
            "git_dirty": dirty, "device_count": torch.cuda.device_count() if env.device.type == "cuda" else 0,
            "hosts": env.topology.num_hosts, "mode": args.mode, "routing": args.routing, "quant": args.quant,
            "iters": args.iters, "warmup": args.warmup, "sets": args.sets, "baseline_backend": baseline_backend,
            "torch": torch.__version__, "launcher": env.launcher, "failures": failures,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        print(_plot(results, args.plot, baseline_backend), flush=True)


def _plot(results: list[dict], path: str, baseline_backend: str) -> str:
    """p50 latency vs tokens, one panel per op, one line per backend/layout, baseline dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on cluster nodes
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install 'ep-comm[plot]'); {path} not written"
    if not results:
        return f"--plot: no results to plot; {path} not written"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, op in zip(axes, ("dispatch", "combine")):
        series: dict[str, list[tuple[int, float]]] = {}
        base: dict[int, float] = {}
        for r in results:
            if r["op"] == op:
                series.setdefault(f"{r['backend']}/{r['layout']}", []).append((r["tokens"], r["p50_us"]))
                base[r["tokens"]] = r["baseline_nccl_us"]
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        xs = sorted(base)
        ax.plot(xs, [base[x] for x in xs], "k--", marker="x", label=f"{baseline_backend} all_to_all_single")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("p50 latency (µs, max over ranks)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
