"""Where the host time of one eager dispatch / combine goes (collective and kernel backends).

    python3 bench/eager_breakdown.py --nproc 2 --tokens 128            # GPU: one rank per GPU
    python3 bench/eager_breakdown.py --nproc 2 --backend mnnvl --validate-ids off
    CUDA_VISIBLE_DEVICES= python3 bench/eager_breakdown.py --nproc 2 --hidden 512 --experts 32 --topk 4

Every rank wraps the pieces an eager call goes through (input checks, the id range check and its
device sync, the control plane's host agreement, the routing guard, packing, the collectives, the
layout selection, the combine partial sums; for a kernel backend the error poll, the id check and
the op call itself) with host timers, runs ``--iters`` dispatch+combine
pairs lined up like ``ep-comm bench --mode eager``, and prints the mean host µs per call of each
piece (slowest rank) next to the end-to-end op time.  On GPUs the pieces' host time is launch and
sync cost (kernels run asynchronously); the end-to-end time includes the device work.  It also
counts the aten ops one dispatch and one combine issue (views apart, each is a kernel launch on a GPU).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ep_comm  # noqa: E402
from ep_comm import oracle  # noqa: E402
from ep_comm.backends.collective import flow, invalid_ids  # noqa: E402
from ep_comm.backends.one_sided import backend as one_sided  # noqa: E402
from ep_comm.cli.launcher import _SPAWNED_ENV, gather_objects, host_barrier, setup_rank  # noqa: E402
from ep_comm.distributed.spawn import raise_on_failure, spawn_local  # noqa: E402

PIECES_MODULE = {  # module attribute -> label
    (one_sided, "check_ids"): "id check: naming the token", (invalid_ids, "check_ids"): "id check: naming the token",
    (invalid_ids.InvalidIds, "route"): "id check (dropped and counted) and routing guard",
    (invalid_ids.InvalidIds, "raise_if_any"): "id check (reads every rank's count)",
    (flow, "pack"): "pack", (flow, "unpack"): "unpack", (flow, "select_local"): "select layout",
    (flow, "reduce_buffer"): "reduce buffer", (flow, "combine_partial"): "combine partial sums",
}


# methods -> labels: of the collective backends, and of the one-sided backends' kernels (comm._impl.kernels)
BACKEND_PIECES = {"gather": "dispatch collective", "reduce": "combine collective"}
KERNEL_PIECES = {"fatal_pending": "error poll", "start_verdict": "input verdict (queued)",
                 "wait_verdict": "input verdict (waits for the verdict kernel)",
                 "dispatch": "op call: dispatch (+ outputs)", "combine": "op call: combine"}


def _wrap(acc: dict, label: str, fn, sync: bool):
    def timed(*a, **k):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            if sync:
                torch.cuda.synchronize()
            acc[label].append(time.perf_counter() - t0)
    return timed


_VIEW_OPS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "as_strided", "alias",
             "t", "detach", "permute", "split", "split_with_sizes", "unbind", "_reshape_alias", "empty", "empty_like",
             "new_empty", "lift_fresh", "_to_copy_noop"}


def count_ops(fn) -> dict:
    """``{"ops": n, "kernels": m}``: aten ops that ``fn`` issues, and those that are not views or
    allocations (a kernel launch each on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = collections.Counter()

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            counts["ops"] += 1
            if name not in _VIEW_OPS:
                counts["kernels"] += 1
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return dict(counts)


def rank_main(args: argparse.Namespace) -> dict:
    env = setup_rank(300.0)
    cuda = env.device.type == "cuda"
    cfg = ep_comm.EPConfig(num_experts=args.experts, top_k=args.topk, hidden=args.hidden,
                           max_tokens_per_rank=args.tokens, dtype=torch.bfloat16, layout=args.layout,
                           backend=args.backend, validate_ids=args.validate_ids == "on")
    comm = ep_comm.Communicator(cfg)
    inputs = oracle.random_inputs(cfg, env.world_size, seed=1, tokens=[args.tokens] * env.world_size)
    inp = inputs[env.rank].to(env.device)
    acc: dict = collections.defaultdict(list)
    pieces = dict(PIECES_MODULE)
    originals = {key: getattr(*key) for key in pieces}

    eo_cache: dict = {}

    def expert_out(d):  # one zero buffer per shape, allocated outside the timed calls
        key = tuple(d.x.shape)
        if key not in eo_cache:
            eo_cache[key] = torch.zeros((*d.x.shape[:-1], cfg.hidden), dtype=cfg.dtype, device=env.device)
        return eo_cache[key]

    def pair():
        d = comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)
        comm.combine(expert_out(d), d)

    for _ in range(args.warmup):
        pair()
    holder: dict = {}
    op_counts = {"dispatch": count_ops(lambda: holder.update(d=comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)))}
    op_counts["combine"] = count_ops(lambda: comm.combine(expert_out(holder["d"]), holder["d"]))
    # end-to-end first (no wrappers), like the bench: lined up, synced
    e2e = collections.defaultdict(list)
    for _ in range(args.iters):
        host_barrier(env)
        t0 = time.perf_counter()
        d = comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        comm.combine(expert_out(d), d)
        if cuda:
            torch.cuda.synchronize()
        e2e["dispatch"].append(t1 - t0)
        e2e["combine"].append(time.perf_counter() - t1)
    # then the pieces (host time; with --sync also the device time of each piece)
    try:
        for (mod, name), label in pieces.items():
            setattr(mod, name, _wrap(acc, label, originals[(mod, name)], cuda and args.sync))
        start = comm.control.agree_start

        def agree_start(*a, **k):  # the send, then the wait
            wait = _wrap(acc, "host agreement: send", start, False)(*a, **k)
            return _wrap(acc, "host agreement: wait", wait, cuda and args.sync)

        comm.control.agree_start = agree_start
        for name in ("dispatch", "combine"):
            setattr(comm._checks, name, _wrap(acc, "validate", getattr(comm._checks, name), cuda and args.sync))
        kernel = comm.capabilities.recv_hooks
        target = comm._impl.kernels if kernel else comm._impl
        for name, label in (KERNEL_PIECES if kernel else BACKEND_PIECES).items():
            setattr(target, name, _wrap(acc, label, getattr(target, name), cuda and args.sync))
        for _ in range(args.iters):
            host_barrier(env)
            pair()
    finally:
        for (mod, name) in pieces:
            setattr(mod, name, originals[(mod, name)])
    host_barrier(env)
    mine = {"e2e": {k: sorted(v)[len(v) // 2] * 1e6 for k, v in e2e.items()},
            "pieces": {k: sum(v) / args.iters * 1e6 for k, v in acc.items()}, "ops": op_counts}
    everyone = gather_objects(env, mine)
    comm.close()
    dist.destroy_process_group()
    return everyone[0] if env.rank else {"ranks": everyone}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--backend", default="ag_rs")
    p.add_argument("--layout", default="standard")
    p.add_argument("--validate-ids", choices=("on", "off"), default="on",
                   help="EPConfig.validate_ids (off removes the id check's sync)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--ops", action="store_true", help="list the kernels (aten ops) each op issues")
    p.add_argument("--sync", action="store_true", help="GPU: sync around every piece (device time per piece)")
    args = p.parse_args()
    res = raise_on_failure(spawn_local(rank_main, args.nproc, (args,), timeout_s=600,
                                     extra_env=lambda r: {_SPAWNED_ENV: str(args.nproc)}))[0]["ranks"]
    print(f"{args.backend}/{args.layout}, {args.nproc} ranks, {args.tokens} tok, hidden {args.hidden}, "
          f"top-{args.topk} of {args.experts}; µs, slowest rank")
    for op in ("dispatch", "combine"):
        ops = res[0]["ops"][op]
        print(f"  eager {op} p50 (end to end): {max(r['e2e'][op] for r in res):9.1f}   "
              f"({ops.get('kernels', 0)} kernels in {ops.get('ops', 0)} aten ops on rank 0)")
    if args.ops:
        for op in ("dispatch", "combine"):
            top = sorted(((n, c) for n, c in res[0]["ops"][op].items() if n not in ("ops", "kernels")),
                         key=lambda t: -t[1])
            print(f"  {op} kernels: " + ", ".join(f"{n} {c}" for n, c in top))
    labels = sorted({k for r in res for k in r["pieces"]}, key=lambda k: -max(r["pieces"].get(k, 0) for r in res))
    for k in labels:
        print(f"  {k:28s} {max(r['pieces'].get(k, 0.0) for r in res):9.1f} per pair")


if __name__ == "__main__":
    main()
