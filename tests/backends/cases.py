"""Rank-side bodies shared by the CPU (gloo) and GPU (NCCL) backend tests.

Each function runs inside a spawned rank, builds every rank's inputs from a shared seed, runs the real
Communicator and compares with the oracle; it returns ``{case name: [problems]}`` so the parent test
can report every failing case at once.
"""
from __future__ import annotations

import itertools
import os
from typing import Callable, Optional

import torch

import ep_comm
from ep_comm import oracle
from ep_comm.cli import written_to_input_buffer

HIDDEN = 256
EXPERTS_PER_RANK = 3


SHARED_GPU_ENV = "EP_COMM_TEST_SHARED_GPU"
# More ranks than GPUs (world 4 on a two-GPU machine): the multi-source paths run where no larger machine
# is lent.  The ranks share the GPUs round-robin and bootstrap over gloo (NCCL refuses two ranks on one GPU).
WORLD_ENV = "EP_COMM_TEST_WORLD"


def kernel_test_world(ngpu: int) -> tuple[int, Optional[Callable[[int], dict]]]:
    """``(world, extra_env)`` for the kernel backends' multi-rank tests: one rank per GPU, at least 2 (two
    ranks on one GPU), or ``$EP_COMM_TEST_WORLD`` ranks spread over the GPUs."""
    world = int(os.environ.get(WORLD_ENV) or 0) or max(ngpu, 2)
    return world, (None if ngpu >= world else (lambda rank: {SHARED_GPU_ENV: "1"}))


def merge_ranks(per_rank) -> dict:
    """``{case: [problems]}`` of every rank into one dict, each problem prefixed with its rank."""
    merged: dict = {}
    for rank, res in enumerate(per_rank):
        for key, problems in res.items():
            merged.setdefault(key, []).extend(f"rank {rank}: {p}" for p in problems)
    return merged


def init_rank():
    """``(topology, device)`` of a test rank.  Normally one GPU per rank (NCCL) or CPU (gloo), device
    None (the communicator's default).  With ``$EP_COMM_TEST_SHARED_GPU=1`` every rank bootstraps over
    gloo and uses GPU ``rank % device_count``: the kernel backends then run at world 2 on a one-GPU machine,
    or at world 4 on two GPUs."""
    if os.environ.get(SHARED_GPU_ENV) == "1":
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        index = dist.get_rank() % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return ep_comm.init_distributed(), torch.device("cuda", index)
    return ep_comm.init_distributed(), None


def make_cfg(world: int, backend: str, layout: str, quant: Optional[str], max_tokens: int = 16,
             **kw) -> ep_comm.EPConfig:
    """The tests' small shape; any EPConfig field can be overridden through ``kw``."""
    fields = dict(num_experts=EXPERTS_PER_RANK * world, top_k=4, hidden=HIDDEN, dtype=torch.bfloat16, timeout_s=60.0)
    fields.update(kw)
    return ep_comm.EPConfig(max_tokens_per_rank=max_tokens, layout=layout, backend=backend, quant=quant, **fields)


def scenarios(world: int, max_tokens: int) -> dict[str, dict]:
    uneven = [max_tokens, 0, 3, 7, 1, 11, 0, 2][:world]
    return {
        "uneven_and_zero_T": dict(tokens=uneven),
        "T_equals_max_skewed": dict(tokens=[max_tokens] * world, routing="skewed"),
        "minus_one_and_duplicates": dict(tokens=[5] + [max_tokens] * (world - 1), p_minus_one=0.25, p_duplicate=0.3),
        "all_ranks_zero_T": dict(tokens=[0] * world),
    }


PAYLOADS = {  # name -> (quant, payload kind, scales width)
    "bf16+scales": (None, "dtype", 3),
    "fp8": ("fp8", "dtype", 0),
    "nvfp4": ("nvfp4", "dtype", 0),  # x of cfg.dtype, x_scales its global scale (oracle.random_inputs)
    "uint8_opaque": (None, "uint8", 0),
}


def _other_work(device) -> None:
    """A kernel between a split call's send half and its receive hook, as an engine would run."""
    a = torch.rand(256, 256, device=device)
    (a @ a).sum()


def dispatch(comm, hooks: bool, *args):
    """``comm.dispatch(*args)``; with ``hooks`` split: send, other work, then the receive hook."""
    if not hooks:
        return comm.dispatch(*args)
    d, hook = comm.dispatch(*args, return_recv_hook=True)
    _other_work(comm.device)
    hook()
    return d


def combine(comm, hooks: bool, expert_out, d):
    if not hooks:
        return comm.combine(expert_out, d)
    y, hook = comm.combine(expert_out, d, return_recv_hook=True)
    _other_work(comm.device)
    hook()
    return y


INPUT_IN_PLACE_ENV = "EP_COMM_TEST_INPUT_IN_PLACE"


def input_in_place(on: bool) -> None:
    """Dispatches of ``cfg.dtype`` payloads write x into ``comm.dispatch_input_buffer()`` and pass its
    first T rows (set in the spawned rank)."""
    os.environ[INPUT_IN_PLACE_ENV] = "1" if on else "0"


def placed_input(comm, x: torch.Tensor) -> torch.Tensor:
    """``x`` written into the communicator's dispatch input buffer when ``input_in_place`` is on (and x
    is of ``cfg.dtype``), else ``x``."""
    return written_to_input_buffer(comm, x) if os.environ.get(INPUT_IN_PLACE_ENV) == "1" else x


def run_case(comm, cfg, world: int, rank: int, seed: int, payload: str, spec: dict, hooks: bool = False,
             outputs: Optional[list] = None) -> list[str]:
    """Problems of one dispatch + combine against the oracle; ``outputs`` (a list) gets the combine's result."""
    quant, kind, swidth = PAYLOADS[payload]
    inputs = oracle.random_inputs(cfg, world, seed, payload=kind, scales_width=swidth, **spec)
    mine = inputs[rank].to(comm.device)
    x = placed_input(comm, mine.x)
    d = dispatch(comm, hooks, x, mine.topk_ids, mine.topk_weights, mine.x_scales)
    problems = [f"dispatch: {p}" for p in oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs)[rank])]
    expert_out = oracle.run_experts(cfg, rank, world, d)  # padding rows/slots are NaN
    y = combine(comm, hooks, expert_out, d)
    if outputs is not None:
        outputs.append(y.clone())
    if y.dtype != cfg.dtype:
        problems.append(f"combine dtype {y.dtype}")
    want = oracle.expected_combine_rank(cfg, inputs, rank)
    problems += [f"combine: {p}" for p in oracle.compare_combine(cfg, y, want)]
    return problems


def backend_matrix(backends=("naive", "ag_rs"), layouts=("standard", "batched"), repeats: int = 1,
                   hooks: bool = False, **cfg_kw) -> dict:
    """Every payload x scenario through one communicator per (backend, layout, payload); ``cfg_kw``:
    make_cfg overrides."""
    topo, device = init_rank()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    seed = 1000
    for backend, layout, payload in itertools.product(backends, layouts, PAYLOADS):
        quant = PAYLOADS[payload][0]
        cfg = make_cfg(world, backend, layout, quant, **cfg_kw)
        with ep_comm.Communicator(cfg, device=device) as comm:
            if comm.backend != backend:
                results[f"{backend}/{layout}/{payload}"] = [f"resolved backend {comm.backend}"]
                continue
            # several calls back to back on one communicator: buffers reused without a barrier
            for _ in range(repeats):
                for name, spec in scenarios(world, cfg.max_tokens_per_rank).items():
                    seed += 1
                    key = f"{backend}/{layout}/{payload}/{name}"
                    results[key] = results.get(key, []) + run_case(comm, cfg, world, rank, seed, payload, spec,
                                                                   hooks)
    return results


WIDE_HIDDEN = 2048  # 4 KB bf16 rows: the kernels split a row into several pieces sent by different warps


def wide_rows_case_names(backend: str, layouts: tuple[str, ...] = ("standard",)) -> list[str]:
    """The keys ``wide_rows_matrix`` reports for ``backend`` and ``layouts``."""
    return [f"wide/{backend}/{layout}/{p}/{s}" for layout in layouts for p in PAYLOADS for s in scenarios(2, 16)]


def wide_rows_matrix(backends=("mnnvl",), hooks: bool = False, layouts=("standard", "batched"), **cfg_kw) -> dict:
    """The matrix with rows wide enough to go in several pieces (hidden = WIDE_HIDDEN; the other cases'
    512-byte rows go whole), keyed ``wide/...``: each piece is laid out by its own warp, at an offset
    past its row's start, and only the first carries the row's scales."""
    res = backend_matrix(backends, layouts, 1, hooks, hidden=WIDE_HIDDEN, **cfg_kw)
    return {f"wide/{k}": v for k, v in res.items()}


# -- CUDA graphs -------------------------------------------------------------------------------------
def graph_experts(cfg, rank: int, world: int, d) -> torch.Tensor:
    """``oracle.test_expert`` vectorised without host syncs, so it can sit inside a CUDA graph."""
    L = cfg.num_experts // world
    xf = oracle.payload_as_float(cfg, d.x, d.x_scales, d.x_global_scale)
    if d.layout == "batched":
        e = torch.arange(rank * L, (rank + 1) * L, device=xf.device, dtype=torch.float32).view(L, 1, 1)
        return (torch.tanh(xf) * (1.0 + 0.25 * torch.remainder(e, 5)) + 0.01 * e).to(cfg.dtype)
    valid = d.topk_ids >= 0
    g = (d.topk_ids + rank * L).float()
    w = torch.where(valid, d.topk_weights, 0.0)
    scale = (w * (1.0 + 0.25 * torch.remainder(g, 5))).sum(1, keepdim=True)
    shift = (w * 0.01 * g).sum(1, keepdim=True)
    return (torch.tanh(xf) * scale + shift).to(cfg.dtype)


def graph_capture(backends=("naive", "ag_rs"), layouts=("standard", "batched"), replays: int = 3,
                  hooks: bool = False, seed: int = 100, quants=(None, "fp8"), **cfg_kw) -> dict:
    """Capture dispatch + combine once (``hooks``: split calls with their receive hooks), replay with
    fresh inputs (seeds ``seed``, ``seed + 1``, ...), compare with the oracle, then an out-of-range id
    during a replay.  ``quants``: the EPConfig.quant values to run (NVFP4: each replay's global scale is
    written into the captured one).  ``cfg_kw``: make_cfg overrides."""
    topo, device = init_rank()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    for backend, layout, quant in itertools.product(backends, layouts, quants):
        cfg = make_cfg(world, backend, layout, quant, **cfg_kw)
        key = f"{backend}/{layout}/{quant or 'bf16'}"
        problems: list[str] = []
        tokens = [cfg.max_tokens_per_rank - r for r in range(world)]  # fixed T per rank, differing
        with ep_comm.Communicator(cfg, device=device) as comm:
            first = oracle.random_inputs(cfg, world, 7, tokens=tokens)[rank].to(comm.device)
            x_s, ids_s, w_s = placed_input(comm, first.x.clone()), first.topk_ids.clone(), first.topk_weights.clone()
            gs_s = None if first.x_scales is None else first.x_scales.clone()  # NVFP4's global scale
            # eager warm-up (the same calls) initialises NCCL communicators and cuBLAS outside the capture
            d = dispatch(comm, hooks, x_s, ids_s, w_s, gs_s)
            combine(comm, hooks, graph_experts(cfg, rank, world, d), d)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                d_s = dispatch(comm, hooks, x_s, ids_s, w_s, gs_s)
                y_s = combine(comm, hooks, graph_experts(cfg, rank, world, d_s), d_s)
            for rep in range(replays):
                inputs = oracle.random_inputs(cfg, world, seed + rep, tokens=tokens, p_minus_one=0.1, p_duplicate=0.2)
                mine = inputs[rank].to(comm.device)
                x_s.copy_(mine.x), ids_s.copy_(mine.topk_ids), w_s.copy_(mine.topk_weights)
                if gs_s is not None:
                    gs_s.copy_(mine.x_scales)
                if cfg.zero_copy:  # the rows compared below are the buffer's: no peer may replay before
                    comm.control.barrier()
                graph.replay()
                torch.cuda.synchronize()
                problems += [f"replay {rep} dispatch: {p}" for p in
                             oracle.compare_dispatch(cfg, d_s, oracle.expected_dispatch(cfg, inputs)[rank])]
                problems += [f"replay {rep} combine: {p}" for p in
                             oracle.compare_combine(cfg, y_s, oracle.expected_combine_rank(cfg, inputs, rank))]
            comm.check_errors()  # nothing was flagged on clean replays
            # an out-of-range id inside a replay is counted and reported, not an illegal access
            ids_s[0, 0] = cfg.num_experts + 5
            graph.replay()
            try:
                comm.check_errors()
                problems.append("check_errors did not report an out-of-range id seen during replay")
            except ep_comm.EPInputError as exc:
                if "treated as -1" not in str(exc):
                    problems.append(f"unexpected check_errors message: {exc}")
        results[key] = problems
    return results


# -- the device-side (op, epoch) headers, forced on outside a CUDA graph -----------------------------------
def device_headers(backend: str) -> dict:
    """Run the graph-capture path outside a graph (padded sizes, no host agreement, (op, epoch) headers
    checked on the device): clean calls match the oracle and raise nothing; a peer whose data carries
    another epoch is counted and reported by ``check_errors``.  The backend's halves are driven
    directly for the mismatch, so the host control plane, which would catch it first, stays out."""
    from ep_comm.backends.collective import flow
    from ep_comm.backends.collective.packing import RoutedBatch
    from ep_comm.routing import sanitize_routing

    flow.capturing_graph = lambda device: True
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    out: dict[str, list[str]] = {}
    for layout in ("standard", "batched"):
        cfg = make_cfg(world, backend, layout, None)
        with ep_comm.Communicator(cfg) as comm:
            out[f"{layout}/clean"] = run_case(comm, cfg, world, rank, 77, "bf16+scales",
                                              dict(tokens=[cfg.max_tokens_per_rank] * world))
            try:
                comm.check_errors()
            except ep_comm.EPError as exc:
                out[f"{layout}/clean"].append(f"clean run flagged: {exc}")
            inp = oracle.random_inputs(cfg, world, 78)[rank]
            ids, w, _ = sanitize_routing(inp.topk_ids, inp.topk_weights, cfg.num_experts)
            epoch = 40 + (rank == 1)  # rank 1 is one call ahead
            batch = RoutedBatch(inp.x, None, ids, w, epoch, None)
            d = comm._impl.exchange_dispatch(batch, comm._impl.prepare_dispatch(batch, eager=False))
            problems = []
            try:
                comm.check_errors()
                problems.append("dispatch epoch mismatch not reported")
            except ep_comm.EPError as exc:
                if "another call's epoch" not in str(exc):
                    problems.append(f"unexpected: {exc}")
            expert_out = oracle.run_experts(cfg, rank, world, d)
            comm._impl.exchange_combine(d, torch.empty(d.num_tokens, cfg.hidden, dtype=cfg.dtype),
                                        comm._impl.prepare_combine(expert_out, d))
            try:
                comm.check_errors()
                problems.append("combine epoch mismatch not reported")
            except ep_comm.EPError as exc:
                if "another call's epoch" not in str(exc):
                    problems.append(f"unexpected: {exc}")
            out[f"{layout}/mismatch"] = problems
    return out


# -- validate_ids=False on the collective backends: no host sync, dropped ids raised later -------------
def unchecked_ids(backend: str) -> dict:
    """Eager dispatch with ``validate_ids=False``: out-of-range ids on rank 0 go as -1 (results match
    the oracle on the cleaned ids), no host synchronisation on a GPU, and a later dispatch (or
    ``check_errors()``) raises on every rank; the communicator stays usable."""
    topo, device = init_rank()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    for layout in ("standard", "batched"):
        problems: list[str] = []
        cfg = make_cfg(world, backend, layout, None, validate_ids=False)
        with ep_comm.Communicator(cfg, device=device) as comm:
            cuda = comm.device.type == "cuda"

            def no_sync(call, *args, cuda=cuda):
                """``call(*args)``; on a GPU any host synchronisation inside it raises."""
                if not cuda:
                    return call(*args)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return call(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            def run(inputs, expected, label: str, *, cfg=cfg, problems=problems) -> None:
                mine = inputs[rank].to(comm.device)
                d = no_sync(comm.dispatch, mine.x, mine.topk_ids, mine.topk_weights)
                y = no_sync(comm.combine, oracle.run_experts(cfg, rank, world, d), d)
                problems.extend(f"{label} dispatch: {p}" for p in
                                oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, expected)[rank]))
                problems.extend(f"{label} combine: {p}" for p in
                                oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, expected, rank)))

            def bad_inputs(seed: int, *, cfg=cfg):
                inputs = oracle.random_inputs(cfg, world, seed, tokens=[6] * world, p_duplicate=0.2)
                bad = [oracle.RankInput(i.x, i.topk_ids.clone(), i.topk_weights) for i in inputs]
                bad[0].topk_ids[0, 1] = cfg.num_experts + 3
                bad[0].topk_ids[1, 0] = -7
                cleaned = [oracle.RankInput(i.x, i.topk_ids.clone(), i.topk_weights) for i in bad]
                cleaned[0].topk_ids[0, 1] = -1
                cleaned[0].topk_ids[1, 0] = -1
                return bad, cleaned

            clean = oracle.random_inputs(cfg, world, 501, p_minus_one=0.1, p_duplicate=0.2)
            run(clean, clean, "clean")
            bad, cleaned = bad_inputs(502)
            run(bad, cleaned, "dropped ids")  # sent as -1, no error yet
            if cuda:
                torch.cuda.synchronize()  # the count has reached the host: the next dispatch sees it
            mine = clean[rank].to(comm.device)
            try:
                comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
                problems.append("the dispatch after dropped ids did not raise")
            except ep_comm.EPError as exc:
                text = str(exc)
                if rank == 0 and ("2 topk_ids" not in text or "validate_ids=False" not in text):
                    problems.append(f"rank 0's message: {text}")
                if rank != 0 and "rank 0" not in text:
                    problems.append(f"a peer's message does not name rank 0: {text}")
            run(clean, clean, "after the error")  # reported once, and still usable
            bad, cleaned = bad_inputs(503)
            run(bad, cleaned, "dropped again")
            try:  # check_errors reports them too (here rank 0's), and only once
                comm.check_errors()
                if rank == 0:
                    problems.append("check_errors did not report the dropped ids")
            except ep_comm.EPInputError as exc:
                if rank != 0 or "2 topk_ids" not in str(exc):
                    problems.append(f"check_errors on rank {rank}: {exc}")
            run(clean, clean, "after check_errors")
        results[f"{backend}/{layout}"] = problems
    return results
