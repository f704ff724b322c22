"""``ep-comm bench``: dispatch/combine latency and bandwidth per backend × layout (docs/performance.md).

The backends and layouts to run are decided once, before anything is timed: those every rank can run
(the backends' own availability probes, agreed by all ranks).  A backend that cannot run is named once
with its reason: a note when it came from ``all``, a failure of the run when it was asked for by name.
Progress lines (stderr) number the rows that run.

For every token count: the all_to_all_single baseline is timed once, then, for every backend and
layout that runs:

1. one communicator is created (``max_tokens_per_rank`` = the token count, so capacities are real);
2. its output is checked once against ``ep_comm.oracle`` on at most ``--check-tokens`` tokens per
   rank (and, in graph mode, graph replays are checked against the eager result), so a fast but
   wrong backend is reported as a failure instead of being timed;
3. dispatch and combine are timed separately, after ``--warmup`` untimed pairs, over ``--sets`` run
   sets with fresh random routing each.  Ranks are lined up on the host before every timed pair.
   CUDA events on GPUs, ``perf_counter`` on CPUs.
4. with ``--env NAME=V1,V2,...``, steps 1-3 run once per value of the ep_comm variable NAME (set on
   every rank before the communicator is created, so the variants of a switch share the run, its
   inputs and its baseline);
5. with ``--recv-hook``, on backends with receive hooks (``recv_hooks``), the split calls
   (``return_recv_hook=True``) are checked against the oracle too (before any timing), then each
   half (``dispatch_send``, ``dispatch_recv``, ``combine_send``, ``combine_recv``) is timed the same
   way; other backends are skipped with one progress line.

Reported per op: the max over ranks of each rank's median (p50) and 90th percentile (p90), the
algorithmic bandwidth and the same-run ``all_to_all_single`` baseline (NCCL on GPUs, gloo on CPUs)
with per-peer chunks of ``tokens × hidden`` elements of ``--dtype``.

Every row is printed, and the ``--json`` file rewritten, as soon as the ranks agree on its numbers:
a run that is stopped keeps every row it finished.  The table leaves out what only GPUs have (GB/s,
SMs, host time per eager call) on CPU ranks; the JSON has every key either way.  ``--plot`` needs
matplotlib, checked before any rank starts.  ``--peer deepep`` checks and times DeepEP in the same
processes on the same inputs (see ``ep_comm.cli.peers``).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from ..communicator import Communicator
from ..config import EPConfig
from ..errors import EPConfigError, EPTopologyError
from . import DTYPES, default_backends, resolve_backend_request
from .availability import agreed_reasons, request_blocker
from .bench_measure import (
    HALF_OPS,
    OracleGate,
    bench_config,
    eager_queued,
    input_in_place,
    make_sets,
    percentiles,
    remote_sends,
    time_baseline,
    time_eager,
    time_graph,
    time_hooks_eager,
    time_hooks_graph,
)
from .bench_plot import INSTALL_HINT, matplotlib_problem
from .bench_report import Reporter, device_name
from .launcher import RankEnv, agree_exit_code, gather_objects, launch_gap_us, say, setup_rank, teardown
from .phases import Phases, format_phases, max_over_ranks

FP8_SCALE_BLOCK = 128  # channels per fp8 scale (docs/design.md §5); a float32 scale rides with each block
__all__ = ["add_arguments", "check_arguments", "worker", "remote_sends"]


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
    p.add_argument("--quant", choices=("none", "fp8", "nvfp4"), default="none",
                   help="fp8: dispatch sends e4m3 + per-128-channel scales; nvfp4: e2m1 + an e4m3 scale per 16 "
                        "channels, global scale 448 (default: none)")
    p.add_argument("--validate-ids", choices=("on", "off"), default="on",
                   help="EPConfig.validate_ids: off skips the host check (one sync) of expert ids in eager "
                        "dispatch; out-of-range ids then travel as -1 and a later call raises (default: on)")
    p.add_argument("--zero-copy", action="store_true",
                   help="EPConfig.zero_copy for the standard layout's rows: the kernel backends return the received "
                        "rows as views of their buffer instead of copying them out (batched rows ignore it)")
    p.add_argument("--dispatch-input", choices=("buffer", "tensor"), default="buffer",
                   help="with --zero-copy on the kernel backends: buffer (default) writes x into "
                        "Communicator.dispatch_input_buffer() before timing, so dispatch sends it from where it lies "
                        "and copies no own rows; tensor passes x as a tensor of its own")
    p.add_argument("--eager-launch", choices=("queued", "idle"), default="queued",
                   help="eager mode on GPUs: queued (default) issues each call while the GPU is still busy, as an "
                        "engine's stream is and as graph replays are timed, so p50 is device time and host_us the "
                        "host's time per call; idle issues each call to an idle GPU (host time inside p50)")
    p.add_argument("--iters", type=int, default=50, help="timed dispatch+combine pairs per config (default: 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed pairs first (default: 10)")
    p.add_argument("--sets", type=int, default=5, help="run sets with fresh random routing (default: 5)")
    p.add_argument("--mode", choices=("eager", "graph"), default="eager",
                   help="eager (default), or graph: time replays of CUDA graphs of dispatch and of combine "
                        "(CUDA only)")
    p.add_argument("--check-tokens", type=int, default=512,
                   help="tokens per rank of the oracle check before timing, at most --tokens (default: 512: at "
                        "prefill sizes on up to 32 SMs the kernels then send whole rows and receive while "
                        "sending, the path a 4096-token run times; fewer tokens check the path that splits rows)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the random inputs (default: 0)")
    p.add_argument("--json", metavar="PATH",
                   help="write the JSON report (docs/design.md §2) here (rewritten after every row)")
    p.add_argument("--plot", metavar="PATH",
                   help=f"PNG of p50 latency vs tokens (needs matplotlib: {INSTALL_HINT})")
    p.add_argument("--peer", nargs="+", default=None, metavar="NAME", choices=("deepep", "nccl_ep"),
                   help="also check and time a peer library in the same processes on the same inputs: deepep "
                        "(DeepEP normal and low-latency kernels), nccl_ep (probe only); a peer that is not "
                        "installed is one line, not a failure")
    p.add_argument("--peer-ll-max-tokens", type=int, default=128, metavar="T",
                   help="largest tokens per rank at which the peer's low-latency kernels are timed (default: 128)")
    p.add_argument("--recv-hook", action="store_true",
                   help="also check and time each half of split calls (return_recv_hook=True): dispatch_send, "
                        "dispatch_recv, combine_send, combine_recv rows, on backends with receive hooks (mnnvl); "
                        "other backends are skipped with one line")
    p.add_argument("--env", metavar="NAME=V1,V2,...",
                   help="time every backend and layout once per value of the ep_comm environment variable NAME "
                        "(an EP_COMM_* switch read when a communicator is created, e.g. "
                        "EP_COMM_COMBINE_GROUPED=0,1,split); '-' leaves it unset; values may repeat, to alternate "
                        "them; the rows name their value (column 'variant', JSON 'variant')")
    p.add_argument("--phase-times", action="store_true",
                   help="print the wall time of each phase (spawn, init, create, check, capture, warmup, timing, "
                        "baseline, peer) per row and in total to stderr; the JSON always has them")
    p.add_argument("--inject-fault", action="store_true", help=argparse.SUPPRESS)  # tests: wrong combine


def check_arguments(args: argparse.Namespace) -> Optional[str]:
    """Problems found before any rank starts (so a typo costs no spawn)."""
    args.t_launch = time.time()  # the spawn phase is measured from here
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
    problem = _parse_env_variants(args)
    if problem:
        return problem
    if args.plot:
        problem = matplotlib_problem()
        if problem:
            return problem
    if args.mode == "graph" and not torch.cuda.is_available():
        return "--mode graph captures CUDA graphs and needs CUDA GPUs; this machine has none (use --mode eager)"
    if args.quant == "nvfp4" and args.peer:
        return "--peer times the peer's own dispatch, which has no NVFP4 here: leave out --peer or --quant nvfp4"
    try:
        bench_config(args, max(args.tokens), "standard", "naive")
    except EPConfigError as exc:
        return str(exc)
    return None


#: how many values --env may list
MAX_VARIANTS = 16


def _parse_env_variants(args: argparse.Namespace) -> Optional[str]:
    """``--env NAME=V1,V2`` into ``args.env_name`` and ``args.env_values`` (None: unset); without it
    ``env_name`` is None and the one "variant" is whatever the environment holds."""
    args.env_name, args.env_values = None, [None]
    spec = getattr(args, "env", None)
    if spec is None:
        return None
    name, sep, values = spec.partition("=")
    if not sep or not name.startswith("EP_COMM_") or not values:
        return f"--env expects NAME=V1,V2,... with an EP_COMM_* variable, got {spec!r}"
    listed = values.split(",")
    if not all(listed) or len(listed) > MAX_VARIANTS:
        return f"--env {spec!r}: 1 to {MAX_VARIANTS} non-empty values, comma separated ('-': unset)"
    args.env_name, args.env_values = name, [None if v == "-" else v for v in listed]
    return None


@contextlib.contextmanager
def _variant(name: Optional[str], value: Optional[str]) -> Iterator[None]:
    """The variable ``name`` set to ``value`` (None: unset) on this rank inside the block (a
    communicator's creation, where the switches are read), then as it was; nothing without ``--env``."""
    if name is None:
        yield
        return
    before = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if before is not None:
            os.environ[name] = before


# -- the worker -------------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    phases = Phases()
    phases.add("spawn", max(0.0, time.time() - args.t_launch))
    with phases("init"):
        env = setup_rank(max(300.0, 3 * args.op_timeout))
    try:
        if env.device.type == "cuda":
            with phases("nccl_init"):  # NCCL connects lazily on the first collective: measure it on its own
                dist.all_reduce(torch.zeros(1, device=env.device))
                torch.cuda.synchronize()
        code = agree_exit_code(env, _bench(env, args, phases))
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


class _Progress:
    """Rank 0's progress lines on stderr, stamped with the wall time since the command started."""

    def __init__(self, env: RankEnv, args: argparse.Namespace):
        self.env, self.t0 = env, args.t_launch

    def __call__(self, text: str) -> None:
        say(self.env, f"[{time.time() - self.t0:7.1f}s] {text}", file=sys.stderr)


def _bench(env: RankEnv, args: argparse.Namespace, phases: Phases) -> int:
    world = env.world_size
    if args.experts % world:
        say(env, f"error: --experts {args.experts} is not divisible by the world size {world}")
        return 2
    layouts = ["standard", "batched"] if args.layout == "both" else [args.layout]
    names, explicit, _ = resolve_backend_request(args.backend)
    baseline_backend = "nccl" if env.device.type == "cuda" else "gloo"
    say(env, f"ep-comm bench: {world} ranks on {device_name(env)} ({env.launcher}), hidden {args.hidden}, "
             f"top-{args.topk} of {args.experts} experts, {args.dtype}, quant {args.quant}, {args.routing} routing, "
             f"{args.mode} mode, {args.iters} iters in {args.sets} sets after {args.warmup} warm-up")
    progress = _Progress(env, args)
    if args.phase_times:
        phases.on_start = lambda name: progress(f"  {name}")
    report = Reporter(env, args, baseline_backend, with_peer=bool(args.peer))
    peers = None
    if args.peer:
        from .peers import PeerSuite

        with phases("peer_init"):
            peers = PeerSuite(env, args, report.note)
    with phases("create"):
        runnable, failures = _runnable(env, args, names, layouts, explicit, report)
    report.start()
    gate = OracleGate(env, args)
    variants = [(config, value) for config in runnable for value in args.env_values]
    total = len(args.tokens) * len(variants)
    done, timed_rows = 0, 0
    not_created: set[str] = set()  # backends already named in a "could not be created" note
    no_hooks: set[str] = set()  # backends already named in a "hooks skipped" line
    for tokens in args.tokens:
        progress(f"{tokens} tok: inputs, {baseline_backend} all_to_all_single baseline ({args.mode})")
        with phases("inputs"):
            sets = make_sets(env, args, tokens)
            mean_remote = sum(gather_objects(env, sum(rs.remote_sends for rs in sets) / len(sets))) / world
        with phases("baseline"):
            base_p50, base_p90, base_mode = time_baseline(env, args, tokens)
        base = {"baseline_nccl_us": round(base_p50, 3), "baseline_p90_us": round(base_p90, 3),
                "baseline_backend": baseline_backend, "baseline_mode": base_mode}
        peer_rows: list[dict] = []
        if peers is not None and peers.deepep is not None:
            progress(f"{tokens} tok: peer deepep: oracle check, then timing")
            with phases("peer"):
                peer_rows = peers.run(tokens, sets, gate, mean_remote)
            for r in peer_rows:
                r.update(base, ratio=_sig(r["p50_us"] / base_p50) if base_p50 > 0 else None)
            report.peer_rows(peer_rows)
        for (name, layout), variant in variants:
            done += 1
            which = "" if args.env_name is None else f" ${args.env_name}={variant or '(unset)'}"
            progress(f"{tokens} tok: {name}/{layout}{which} ({done}/{total}): create, oracle check, {args.mode} timing")
            cfg = bench_config(args, tokens, layout, name)
            try:
                with phases("create"), _variant(args.env_name, variant):
                    comm = Communicator(cfg)
            except (EPTopologyError, EPConfigError) as exc:  # raised alike on every rank
                # every rank could run it, yet creating it failed (NVSHMEM could not start, say)
                if explicit:
                    failures += 1
                    report.failure(name, layout, tokens, [f"cannot create: {exc}"], stage="creation", variant=variant)
                elif name not in not_created:
                    not_created.add(name)
                    report.note(f"note: {name}: skipped, could not be created ({exc})")
                continue
            hooks = args.recv_hook and _recv_hooks(comm)
            if args.recv_hook and not hooks and comm.backend not in no_hooks:
                no_hooks.add(comm.backend)
                progress(f"{comm.backend}: no receive hooks (return_recv_hook); --recv-hook rows skipped for it")
            try:
                with phases("check"):
                    problems = gate.check(cfg, comm)
                    if hooks and not problems:  # the split path is timed too: it must be right as well
                        problems = gate.check(cfg, comm, hooks=True)
                timed: Optional[Sequence[list[float]]] = None
                halves: Optional[Sequence[list[float]]] = None
                if not problems:
                    if args.mode == "graph":
                        timed, problems = time_graph(env, cfg, comm, sets, args, phases)
                        if hooks and not problems:
                            halves, problems = time_hooks_graph(env, cfg, comm, sets, args, phases)
                    else:
                        timed = time_eager(env, cfg, comm, sets, args, phases)
                        if hooks:
                            halves = time_hooks_eager(env, cfg, comm, sets, args, phases)
                resolved, sms = comm.backend, _sms_used(comm)
                pulls = comm.capabilities.combine_in_place
                in_place = input_in_place(comm, args)
                agreement = _agreement(comm)
            finally:
                with phases("close"):
                    comm.close()
            if problems or timed is None:
                failures += 1
                report.failure(resolved, layout, tokens, problems, variant=variant)
                continue
            ops = ("dispatch", "combine") + (HALF_OPS if halves is not None else ())
            host = timed[2:]  # eager: host µs per dispatch / combine call
            samples = [*timed[:2], *(halves or ()), *host]
            stats = gather_objects(env, ([percentiles(s) for s in samples], phases.take(), phases.total))
            row_phases = max_over_ranks([s[1] for s in stats])
            rows = []
            for i, op in enumerate(ops):
                p50 = max(s[0][i][0] for s in stats)
                p90 = max(s[0][i][1] for s in stats)
                per_token = _bytes_per_token(cfg, op)
                rows.append({
                    "backend": resolved, "op": op, "layout": layout, "tokens": tokens, "hidden": args.hidden,
                    "top_k": args.topk, "experts": args.experts, "dtype": args.dtype,
                    "p50_us": round(p50, 3), "p90_us": round(p90, 3),
                    "gbps": _sig(mean_remote * per_token / (p50 * 1e-6) / 1e9) if p50 > 0 and per_token else None,
                    "sms": sms, **base, "ratio": _sig(p50 / base_p50) if base_p50 > 0 else None,
                    "mode": args.mode, "routing": args.routing, "quant": args.quant, "world_size": world,
                    "phase_s": row_phases,
                    "combine_pull": pulls,  # the communicator's combine reads expert outputs in place
                    "input_in_place": in_place,  # dispatch read x from the communicator's buffer
                    "variant": variant,  # --env: the variable's value this row ran with (None: unset / no --env)
                })
                if host:  # eager: the host's own time per whole call, max over ranks of its p50
                    rows[-1]["host_p50_us"] = (round(max(s[0][len(ops) + i][0] for s in stats), 3)
                                               if i < len(host) else None)
                    rows[-1]["agreement"] = agreement
            if host and eager_queued(env, args):
                for text in slow_host_notes(rows, launch_gap_us(env.device)):
                    report.note(text)
            if args.peer:
                _add_peer_columns(rows, peer_rows, args.quant == "fp8")
            timed_rows += len(rows)
            report.rows(rows, max_over_ranks([s[2] for s in stats]))
            if args.phase_times:
                progress(f"{tokens} tok: {resolved}/{layout} phases: {format_phases(row_phases)}")
    if peers is not None:
        with phases("peer"):
            peers.close()
    report.finish(max_over_ranks(gather_objects(env, phases.total)), args.phase_times)
    return 1 if failures or not timed_rows else 0


def _runnable(env: RankEnv, args: argparse.Namespace, names: list[str], layouts: list[str], explicit: bool,
              report: Reporter) -> tuple[list[tuple[str, str]], int]:
    """The ``(backend, layout)`` rows this run times, from the availability every rank agrees on, and
    the failures counted on the way.  Collective over the ranks (every rank gets the same rows).

    A backend that cannot run on every rank is reported once with its reason, never as a progress line:
    a note when it came from ``all``, a failure of the run when it was asked for by name.
    """
    cfgs = [bench_config(args, max(args.tokens), layout, "auto") for layout in layouts]
    agreed = dict(zip(layouts, agreed_reasons(env, cfgs, args.op_timeout)))
    runnable: list[tuple[str, str]] = []
    blocked: dict[str, list[str]] = {}  # reason -> the backends (or backend/layout) it blocks
    for name in names:
        why = {layout: request_blocker(cfgs[i].replace(backend=name), agreed[layout])
               for i, layout in enumerate(layouts)}
        runnable += [(name, layout) for layout in layouts if not why[layout]]
        reasons = {w for w in why.values() if w}
        if len(reasons) == 1 and all(why.values()):  # the usual case: the backend, whatever the layout
            blocked.setdefault(reasons.pop(), []).append(name)
        else:
            for layout, w in why.items():
                if w:
                    blocked.setdefault(w, []).append(f"{name}/{layout}")
    failures = 0
    for why_not, labels in blocked.items():
        if explicit:
            for label in labels:
                failures += 1
                report.unusable(label, why_not)
        else:
            report.note(f"note: {', '.join(labels)}: skipped, cannot run on every rank here ({why_not})")
    return runnable, failures


def _add_peer_columns(rows: list[dict], peer_rows: list[dict], fp8: bool) -> None:
    from .peers import match_peer

    for r in rows:
        p = match_peer(r, peer_rows, fp8)
        r["peer"] = None if p is None else f"deepep {p['peer_variant']}"
        r["peer_p50_us"] = None if p is None else p["p50_us"]
        r["vs_peer"] = _sig(r["p50_us"] / p["p50_us"]) if p is not None and p["p50_us"] > 0 else None


def _sig(value: float, digits: int = 4) -> float:
    """Round to significant digits (CPU bandwidths and the ratios of short halves are tiny; fixed
    decimals would store 0)."""
    return float(f"{value:.{digits}g}")


def _bytes_per_token(cfg: EPConfig, op: str) -> Optional[int]:
    """What one token puts on the wire in ``op``: for dispatch fp8/nvfp4 payload + its scales, or hidden × dtype;
    for combine hidden × dtype.  None for a half of a split call: its transfer is not confined to one
    half (the receive half may wait for sends still landing), so bytes ÷ a half's time is no bandwidth."""
    if op == "dispatch":
        if cfg.quant == "fp8":
            return cfg.hidden + (cfg.hidden // FP8_SCALE_BLOCK) * 4
        if cfg.quant == "nvfp4":  # two e2m1 per byte, one e4m3 scale per 16 channels
            return cfg.hidden // 2 + cfg.hidden // 16
        return cfg.hidden * cfg.dtype.itemsize
    if op == "combine":
        return cfg.hidden * cfg.dtype.itemsize
    return None


def _recv_hooks(comm: Communicator) -> bool:
    """Whether the communicator's backend splits calls at a receive hook; asking first avoids the
    EPConfigError a collective backend raises."""
    return comm.capabilities.recv_hooks


def slow_host_notes(rows: list[dict], gap_us: float) -> list[str]:
    """Queued eager rows whose host time per call outlasts the GPU's busy-wait: their p50 then holds part
    of the host's time too (the GPU ran out of queued work), which the reader must know."""
    return [f"{r['backend']}/{r['layout']} {r['op']} at {r['tokens']} tok: the host takes {r['host_p50_us']:.0f} µs "
            f"per call, longer than the {gap_us:.0f} µs the GPU is kept busy before it, so its eager p50 includes "
            "host time (EP_COMM_BENCH_GAP_CYCLES lengthens the busy-wait)"
            for r in rows if r.get("host_p50_us") is not None and r["host_p50_us"] > gap_us]


def _agreement(comm: Communicator) -> Optional[str]:
    """How a collective backend's eager calls agreed on the host; None for the kernel backends, whose
    calls make no host round trip."""
    return comm.capabilities.host_agreement


def _sms_used(comm: Communicator) -> Optional[int]:
    """SMs a kernel backend uses; None for collective backends."""
    return comm.capabilities.num_sms
