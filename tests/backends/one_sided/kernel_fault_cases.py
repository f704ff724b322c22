"""The kernel backends' fault and compile cases, run by test_mnnvl.py and test_nvshmem.py: a rank that
skips a call, close and create again after a timeout, bad input on any rank followed by a call that
must work, and torch.compile over the ops.  Each ``*_worker`` runs on every rank of a spawned world
(tests/backends/cases.py: ``init_rank``) and returns what its test checks."""
from __future__ import annotations

import os
import time

import torch

import ep_comm
from ep_comm import oracle

from .. import cases, zero_copy_cases


def skip_worker(timeout_s: float, backend: str = "mnnvl", skipped: str = "dispatch") -> dict:
    """The last rank skips a call: the next dispatch after a whole round, or (``skipped="combine"``:
    zero copy, pulling combine) the combine of the first dispatch, whose rows its peers wait to read.
    ``skipped="dispatch_receiving_while_sending"``: the dispatch at a size where its peers lay rows out
    while they still send (1 SM, 64 tokens a rank), so they wait on row headers as well as on flags."""
    pulling = skipped == "combine"
    if pulling:
        zero_copy_cases.force_pull(True)
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    size = dict(max_tokens=64, num_sms=1) if skipped == "dispatch_receiving_while_sending" else {}
    cfg = cases.make_cfg(world, backend, "standard", None, timeout_s=timeout_s, zero_copy=pulling, **size)
    comm = ep_comm.Communicator(cfg, device=device)
    inp = oracle.random_inputs(cfg, world, 5)[rank].to(comm.device)
    d = comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)
    if not pulling:
        comm.combine(oracle.run_experts(cfg, rank, world, d), d)
    comm.check_errors()
    res: dict = {"rank": rank}
    if rank != world - 1:  # the last rank skips the next call
        t0 = time.monotonic()
        try:  # an eager dispatch with validate_ids raises it itself: its input verdict never came
            if pulling:
                comm.combine(oracle.run_experts(cfg, rank, world, d), d)
            else:
                comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)
            comm.check_errors()
            res["error"] = None
        except ep_comm.EPTimeoutError as exc:
            res["error"], res["missing"], res["lost"] = str(exc), list(exc.missing_ranks), list(exc.lost_ranks)
        res["elapsed"] = time.monotonic() - t0
        try:
            comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)
            res["later"] = "no error"
        except ep_comm.EPError as exc:
            res["later"] = type(exc).__name__
    t0 = time.monotonic()
    comm.close()
    res["close_s"] = time.monotonic() - t0
    return res


def check_skipper_named(res: dict, world: int) -> None:
    """A survivor's ``skip_worker`` result names the skipping rank (the last) as the one whose signal
    never came.  At world > 2 a survivor that timed out first may have closed its end already: then
    it is named too, as gone (``lost_ranks``), never as a rank that did not signal."""
    assert res["error"] is not None, res
    assert f"no signal from rank(s) [{world - 1}]" in res["error"], res
    assert world - 1 in res["missing"], res
    assert set(res["missing"]) - {world - 1} <= set(res["lost"]), res


def recreate_after_timeout_worker(backend: str, cycles: int) -> dict:
    """``cycles`` times: create a communicator, check one call against the oracle, let the last rank
    skip a dispatch (its peers time out), close on every rank.  Returns what each cycle raised, the
    calls that went wrong, and free GPU memory and open fds after the first and the last cycle."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    cfg = cases.make_cfg(world, backend, "standard", None, timeout_s=0.5)
    res: dict = {"problems": [], "timeouts": 0, "samples": []}
    t_start = time.monotonic()
    for cycle in range(cycles):
        with ep_comm.Communicator(cfg, device=device) as comm:
            inputs = oracle.random_inputs(cfg, world, 1000 + cycle)
            mine = inputs[rank].to(comm.device)
            d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
            y = comm.combine(cases.graph_experts(cfg, rank, world, d), d)
            res["problems"] += [f"cycle {cycle}: {p}" for p in
                                oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))]
            if rank != world - 1:
                try:
                    comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
                    comm.check_errors()
                    res["problems"].append(f"cycle {cycle}: no timeout")
                except ep_comm.EPTimeoutError:
                    res["timeouts"] += 1
        if cycle in (0, cycles - 1):
            torch.cuda.synchronize()
            res["samples"].append((torch.cuda.mem_get_info(device)[0], len(os.listdir("/proc/self/fd"))))
    res["seconds"] = time.monotonic() - t_start
    return res


RECREATE_CYCLES = int(os.environ.get("EP_COMM_TEST_RECREATE_CYCLES", "200"))


def check_recreated(results: list, cycles: int) -> None:
    """What ``recreate_after_timeout_worker`` returned, on every rank: every cycle right, GPU memory
    and fds flat between the first and the last cycle."""
    for rank, res in enumerate(results):
        assert res["problems"] == [], f"rank {rank}: {res['problems'][:5]}"
        if rank != len(results) - 1:
            assert res["timeouts"] == cycles, res
        (free0, fds0), (free1, fds1) = res["samples"]
        assert free0 - free1 < 64 << 20, f"rank {rank}: {(free0 - free1) >> 20} MiB less free GPU memory"
        assert fds1 <= fds0, f"rank {rank}: {fds1 - fds0} more open fds after {cycles} cycles"


def _expect_error(problems: list[str], what: str, fn, *needles: str) -> None:
    """``fn()`` must raise an EPInputError whose text holds every needle."""
    try:
        fn()
        problems.append(f"{what}: no error")
    except ep_comm.EPInputError as exc:
        missing = [n for n in needles if n not in str(exc)]
        if missing:
            problems.append(f"{what}: error lacks {missing}: {exc}")
    except ep_comm.EPError as exc:
        problems.append(f"{what}: {type(exc).__name__} instead of EPInputError: {exc}")


def bad_input_recovery_worker(backend: str = "mnnvl", layout: str = "batched", zero_copy: bool = False) -> list[str]:
    """Eager calls with ``validate_ids`` (the input verdict): bad input on one rank (an out-of-range id,
    a token too many, another hidden size, with and without receive hooks) raises on every rank in the
    same call, and the next call on the same communicator matches the oracle.  A bad combine input on
    one rank: that rank raises at once, its peers' ``check_errors`` name it, and the next call matches."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    cfg = cases.make_cfg(world, backend, layout, None, timeout_s=60.0, zero_copy=zero_copy)
    problems: list[str] = []
    seed = iter(range(300, 400))

    def clean(what: str, hooks: bool = False) -> None:
        inputs = oracle.random_inputs(cfg, world, next(seed))
        mine = inputs[rank].to(comm.device)
        if hooks:
            d, hook = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights, return_recv_hook=True)
            hook()
        else:
            d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
        y = comm.combine(cases.graph_experts(cfg, rank, world, d), d)
        problems.extend(f"{what}: {p}" for p in
                        oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank)))

    def faulty(what: str, bad_rank: int, make, own: str, hooks: bool = False) -> None:
        """A dispatch whose input on ``bad_rank`` (-1: every rank) is ``make(mine)``; every rank must
        raise now."""
        mine = oracle.random_inputs(cfg, world, next(seed))[rank].to(comm.device)
        bad_here = bad_rank in (rank, -1)
        x, ids, w = make(mine) if bad_here else (mine.x, mine.topk_ids, mine.topk_weights)
        t0 = time.monotonic()
        needles = (own,) if bad_here else (f"peer rank(s) [{bad_rank}]", "stays usable")
        _expect_error(problems, what, lambda: comm.dispatch(x, ids, w, return_recv_hook=hooks), *needles)
        if time.monotonic() - t0 > 30:
            problems.append(f"{what}: the error took {time.monotonic() - t0:.1f}s (timeout_s=60)")
        clean(f"after {what}", hooks)

    def bad_id(mine):
        ids = mine.topk_ids.clone()
        ids[min(2, ids.shape[0] - 1), 1] = cfg.num_experts + 4
        return mine.x, ids, mine.topk_weights

    def one_too_many(mine):
        pad = torch.zeros(cfg.max_tokens_per_rank + 1 - mine.x.shape[0], cfg.hidden, dtype=cfg.dtype,
                          device=comm.device)
        ids = torch.full((pad.shape[0], cfg.top_k), -1, dtype=mine.topk_ids.dtype, device=comm.device)
        w = torch.zeros(pad.shape[0], cfg.top_k, device=comm.device)
        return torch.cat([mine.x, pad]), torch.cat([mine.topk_ids, ids]), torch.cat([mine.topk_weights, w])

    def other_hidden(mine):
        return mine.x[:, : cfg.hidden // 2], mine.topk_ids, mine.topk_weights

    last = world - 1
    with ep_comm.Communicator(cfg, device=device) as comm:
        clean("clean 1")
        clean("clean 2")  # both buffer parities
        faulty("rank 0's out-of-range id", 0, bad_id, f"= {cfg.num_experts + 4}")
        faulty(f"rank {last}'s token too many", last, one_too_many, "max_tokens_per_rank")
        faulty("rank 0's hidden size", 0, other_hidden, "hidden")
        faulty("every rank's hidden size", -1, other_hidden, "hidden")  # every rank refuses at once
        faulty(f"rank {last}'s out-of-range id, receive hooks", last, bad_id, f"= {cfg.num_experts + 4}", hooks=True)
        # a combine with expert outputs of the wrong width on rank 1 % world
        bad_rank = 1 % world
        inputs = oracle.random_inputs(cfg, world, next(seed))
        mine = inputs[rank].to(comm.device)
        d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
        eo = cases.graph_experts(cfg, rank, world, d)
        if rank == bad_rank:
            _expect_error(problems, "combine of the wrong width", lambda: comm.combine(eo[..., :8], d), "expert_out")
        else:
            comm.combine(eo, d)
            if world > 1:
                _expect_error(problems, "peer's combine error", comm.check_errors, f"peer rank(s) [{bad_rank}]",
                              "combine")
        clean("after the combine error")
        clean("after the combine error, again")
        comm.check_errors()
    return problems


def validation_off_recovery_worker(backend: str = "mnnvl", layout: str = "standard") -> list[str]:
    """``validate_ids=False``: a dispatch whose input rank 0's host refuses is abandoned with an abort of
    two call numbers; rank 0 raises at once, its peers by their combine (after its launch) or
    ``check_errors()``, and the next call on the same communicator matches the oracle on every rank.
    The same when every rank refuses the same call."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    cfg = cases.make_cfg(world, backend, layout, None, timeout_s=60.0, validate_ids=False)
    problems: list[str] = []
    seed = iter(range(500, 600))
    with ep_comm.Communicator(cfg, device=device) as comm:
        def clean(what: str) -> None:
            inputs = oracle.random_inputs(cfg, world, next(seed))
            mine = inputs[rank].to(comm.device)
            d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
            y = comm.combine(cases.graph_experts(cfg, rank, world, d), d)
            comm.check_errors()
            problems.extend(f"{what}: {p}" for p in
                            oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank)))

        def refused(what: str, bad: set) -> None:
            mine = oracle.random_inputs(cfg, world, next(seed))[rank].to(comm.device)
            if rank in bad:
                _expect_error(problems, what, lambda: comm.dispatch(mine.x[:, : cfg.hidden // 2], mine.topk_ids,
                                                                    mine.topk_weights), "hidden")
                return
            others = sorted(bad)

            def layer() -> None:  # what the peers' hosts do before they can know
                d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
                comm.combine(cases.graph_experts(cfg, rank, world, d), d)
                comm.check_errors()
            _expect_error(problems, what, layer, f"peer rank(s) {others}", "abandoned dispatch")

        clean("clean 1")
        clean("clean 2")
        refused("rank 0's hidden size", {0})
        clean("after rank 0's hidden size")
        clean("after rank 0's hidden size, again")
        refused("every rank's hidden size", set(range(world)))
        clean("after every rank's hidden size")
    return problems


def compile_worker(backend: str = "mnnvl") -> dict:
    """torch.compile over a kernel backend's dispatch op (fullgraph) and over the public API
    (``backend``: mnnvl, or nvshmem, whose ops share the schema)."""
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # no compile worker pool left behind at exit
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    cfg = cases.make_cfg(world, backend, "batched", None)
    out: dict = {}
    with ep_comm.Communicator(cfg, device=device) as comm:
        k = comm._impl.kernels
        dispatch_op = getattr(torch.ops.ep_comm, f"{backend}_dispatch")  # registered once the backend loaded
        inputs = oracle.random_inputs(cfg, world, 21)
        mine = inputs[rank].to(comm.device)

        def through_ops(x, ids, w):  # the ops themselves, compiled whole
            o = dispatch_op(x, ids, w, None, k.state, k.work, k.peer_base, k.expert_owner, k.cfg)
            return o[5], o[0].float().sum()

        counts, _ = torch.compile(through_ops, fullgraph=True)(mine.x, mine.topk_ids, mine.topk_weights)
        want = [sum(c.values()) for c in oracle.expected_dispatch(cfg, inputs)[rank].per_expert]
        out["ops_fullgraph"] = [] if counts.tolist() == want else [f"counts {counts.tolist()} != {want}"]

        def layer(x, ids, w):  # the public API inside a compiled function
            d = comm.dispatch(x, ids, w)
            return comm.combine(cases.graph_experts(cfg, rank, world, d), d)

        y = torch.compile(layer)(mine.x, mine.topk_ids, mine.topk_weights)
        out["communicator"] = oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))
        comm.check_errors()
    return out
