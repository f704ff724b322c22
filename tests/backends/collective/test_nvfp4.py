"""naive and ag_rs with quant="nvfp4" on gloo (CPU) at 2 and 3 spawned ranks: both layouts, every
scenario of the backend matrix plus rows of very different magnitudes, against the dequantising oracle;
the received bytes also equal the reference quantiser's (the family quantises with it); the global
scale comes back as ``x_global_scale``; a rank without the global scale fails the call on every rank
and the communicator stays usable.  On GPUs the same on NCCL, one rank per GPU, and captured in a CUDA
graph (replays with fresh inputs and a new global scale written into the captured one)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.distributed.spawn import raise_on_failure, spawn_local
from ep_comm.quant_nvfp4 import SCALE_DTYPE, quantize_nvfp4

from .. import cases

WORLDS = (2, 3)
BACKENDS = ("naive", "ag_rs")
LAYOUTS = ("standard", "batched")
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _scenarios(world: int, max_tokens: int) -> dict[str, dict]:
    return dict(cases.scenarios(world, max_tokens), magnitudes=dict(tokens=[max_tokens] * world, p_minus_one=0.1))


def _inputs(cfg, world: int, seed: int, name: str, spec: dict) -> list[oracle.RankInput]:
    inputs = oracle.random_inputs(cfg, world, seed, **spec)
    if name != "magnitudes":
        return inputs
    # rows 10**-1.5 .. 10**1.5 apart, a block of zeros in every row and zeros inside blocks: the one
    # global scale must serve them all (new global scale for the scaled data)
    g = torch.Generator().manual_seed(seed)
    out = []
    for inp in inputs:
        t = inp.x.shape[0]
        x = inp.x.float() * torch.pow(10.0, torch.rand(t, 1, generator=g) * 3 - 1.5)
        x[:, 16:32] = 0
        x[torch.rand(x.shape, generator=g) < 0.05] = 0
        out.append(oracle.RankInput(x.to(cfg.dtype), inp.topk_ids, inp.topk_weights))
    return oracle.with_global_scale(out)


def _exact_bytes(cfg, d, inputs, rank: int) -> list[str]:
    """The family quantises with the reference (on CPU and CUDA alike): every received row is byte for
    byte a reference row."""
    d = _on_cpu(d)
    ref = set()
    for inp in inputs:
        packed, scales, _ = quantize_nvfp4(inp.x, inp.x_scales)
        ref |= {packed[t].numpy().tobytes() + scales[t].view(torch.uint8).numpy().tobytes()
                for t in range(packed.shape[0])}
    if d.layout == "batched":
        rows = [(d.x[e, i], d.x_scales[e, i]) for e in range(d.x.shape[0])
                for i in range(int(d.expert_num_tokens[e]))]
    else:
        rows = [(d.x[i], d.x_scales[i]) for i in range(d.x.shape[0]) if bool((d.topk_ids[i] >= 0).any())]
    stray = sum(x.numpy().tobytes() + s.view(torch.uint8).numpy().tobytes() not in ref for x, s in rows)
    return [f"{stray} received rows are not the reference quantiser's bytes"] if stray else []


def _on_cpu(d):
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return dataclasses.replace(d, x=d.x.cpu(), x_scales=cpu(d.x_scales), topk_ids=cpu(d.topk_ids),
                               expert_num_tokens=cpu(d.expert_num_tokens))


def nvfp4_matrix() -> dict:
    """Rank body: ``{backend/layout/dtype/scenario: problems}`` (gloo on CPU, NCCL on GPUs)."""
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    seed = 500
    for backend in BACKENDS:
        for layout in LAYOUTS:
            for dtype in (torch.bfloat16, torch.float32):
                cfg = cases.make_cfg(world, backend, layout, "nvfp4", dtype=dtype)
                with ep_comm.Communicator(cfg) as comm:
                    for name, spec in _scenarios(world, cfg.max_tokens_per_rank).items():
                        seed += 1
                        key = f"{backend}/{layout}/{str(dtype)[6:]}/{name}"
                        results[key] = _one_call(comm, cfg, world, rank, seed, name, spec)
                    results[f"{backend}/{layout}/{str(dtype)[6:]}/no_global_scale"] = _refused(comm, cfg, world, rank)
    return results


def _one_call(comm, cfg, world: int, rank: int, seed: int, name: str, spec: dict) -> list[str]:
    inputs = _inputs(cfg, world, seed, name, spec)
    mine = inputs[rank].to(comm.device)
    d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights, mine.x_scales)
    expected = oracle.expected_dispatch(cfg, inputs)[rank]
    problems = [f"dispatch: {p}" for p in oracle.compare_dispatch(cfg, d, expected)]
    if d.x.dtype != torch.uint8 or d.x_scales is None or d.x_scales.dtype != SCALE_DTYPE:
        scales = None if d.x_scales is None else d.x_scales.dtype
        return problems + [f"dispatched {d.x.dtype} rows with {scales} scales"]
    problems += _exact_bytes(cfg, d, inputs, rank)
    if d.x_global_scale is None or d.x_global_scale.data_ptr() != mine.x_scales.data_ptr():
        problems.append("x_global_scale is not the global scale this rank passed")
    y = comm.combine(oracle.run_experts(cfg, rank, world, d), d)
    if y.dtype != cfg.dtype:
        problems.append(f"combine dtype {y.dtype}")
    want = oracle.expected_combine_rank(cfg, inputs, rank)
    return problems + [f"combine: {p}" for p in oracle.compare_combine(cfg, y, want)]


def _refused(comm, cfg, world: int, rank: int) -> list[str]:
    """Rank 0 leaves the global scale out: every rank raises EPInputError (rank 0 naming the global
    scale); the next call goes through on every rank."""
    inputs = oracle.random_inputs(cfg, world, 99)
    mine = inputs[rank].to(comm.device)
    problems = []
    try:
        comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights, None if rank == 0 else mine.x_scales)
        problems.append("a dispatch without the global scale on rank 0 went through")
    except ep_comm.EPInputError as exc:
        if rank == 0 and "global scale" not in str(exc):
            problems.append(f"rank 0's error does not name the global scale: {exc}")
    problems += _one_call(comm, cfg, world, rank, 98, "after_refusal", dict(tokens=[5] * world))
    return problems


_cache: dict = {}


def _results(world: int) -> dict:
    if world not in _cache:
        per_rank = raise_on_failure(spawn_local(nvfp4_matrix, world, timeout_s=600, extra_env=lambda r: CPU_ONLY))
        _cache[world] = cases.merge_ranks(per_rank)
    return _cache[world]


ALL_CASES = [f"{b}/{lay}/{dt}/{s}" for b in BACKENDS for lay in LAYOUTS for dt in ("bfloat16", "float32")
             for s in list(_scenarios(2, 16)) + ["no_global_scale"]]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_nvfp4_matches_the_dequantising_oracle(world, case):
    results = _results(world)
    assert case in results, f"case {case} did not run (ran: {sorted(results)[:4]}...)"
    assert results[case] == [], "\n".join(results[case])


# -- GPUs: NCCL, one rank per GPU -----------------------------------------------------------------------
def nvfp4_graph() -> dict:
    """Rank body: dispatch + combine captured once per backend and layout, replayed with fresh inputs."""
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    for backend in BACKENDS:
        for layout in LAYOUTS:
            cfg = cases.make_cfg(world, backend, layout, "nvfp4")
            tokens = [cfg.max_tokens_per_rank - r for r in range(world)]  # fixed T per rank, differing
            problems: list[str] = []
            with ep_comm.Communicator(cfg) as comm:
                first = oracle.random_inputs(cfg, world, 7, tokens=tokens)[rank].to(comm.device)
                x_s, ids_s, w_s, gs_s = (t.clone() for t in (first.x, first.topk_ids, first.topk_weights,
                                                              first.x_scales))
                d = comm.dispatch(x_s, ids_s, w_s, gs_s)  # warm-up outside the capture
                comm.combine(_graph_experts(cfg, rank, world, d), d)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    d_s = comm.dispatch(x_s, ids_s, w_s, gs_s)
                    y_s = comm.combine(_graph_experts(cfg, rank, world, d_s), d_s)
                for rep in range(3):
                    inputs = oracle.random_inputs(cfg, world, 200 + rep, tokens=tokens, p_minus_one=0.1)
                    mine = inputs[rank].to(comm.device)
                    for static, new in ((x_s, mine.x), (ids_s, mine.topk_ids), (w_s, mine.topk_weights),
                                        (gs_s, mine.x_scales)):
                        static.copy_(new)
                    graph.replay()
                    torch.cuda.synchronize()
                    want = oracle.expected_dispatch(cfg, inputs)[rank]
                    problems += [f"replay {rep} dispatch: {p}" for p in oracle.compare_dispatch(cfg, d_s, want)]
                    problems += [f"replay {rep} combine: {p}" for p in
                                 oracle.compare_combine(cfg, y_s, oracle.expected_combine_rank(cfg, inputs, rank))]
                comm.check_errors()
            results[f"{backend}/{layout}"] = problems
    return results


def _graph_experts(cfg, rank: int, world: int, d) -> torch.Tensor:
    """``cases.graph_experts`` on the dequantised rows (no host sync: it runs inside the graph)."""
    xf = oracle.payload_as_float(cfg, d.x, d.x_scales, d.x_global_scale)
    return cases.graph_experts(cfg.replace(quant=None, dtype=torch.float32), rank, world,
                               dataclasses.replace(d, x=xf, x_scales=None)).to(cfg.dtype)


_gpu_cache: dict = {}


def _gpu_results(name: str, fn) -> dict:
    if name not in _gpu_cache:
        _gpu_cache[name] = cases.merge_ranks(raise_on_failure(spawn_local(fn, torch.cuda.device_count(),
                                                                          timeout_s=900)))
    return _gpu_cache[name]


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("case", [c for c in ALL_CASES if "/bfloat16/" in c])
def test_nvfp4_on_nccl_matches_the_dequantising_oracle(case):
    results = _gpu_results("matrix", nvfp4_matrix)
    assert case in results
    assert results[case] == [], "\n".join(results[case])


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("case", [f"{b}/{lay}" for b in BACKENDS for lay in LAYOUTS])
def test_nvfp4_cuda_graph_capture_and_replay(case):
    results = _gpu_results("graph", nvfp4_graph)
    assert case in results
    assert results[case] == [], "\n".join(results[case])
