"""The vLLM adapter on the kernel backends (mnnvl, nvshmem): both formats, eager and CUDA graphs, with and
without the receive hooks (vLLM's prepare_async/finalize_async), against the dense MoE reference.

Each rank drives the adapter the way vLLM's FusedMoEKernel does (prepare[_async] -> experts ->
finalize[_async] into a fresh output) with plain-torch experts, so the tests need no vLLM kernels.
Where vLLM is not installed (the GPU machines have none) the ranks import the adapter over a stand-in
of the few vLLM names it uses (``examples/vllm_stand_in/``); a warning in the test summary says which one ran.

    python -m pytest -q tests/integrations/test_vllm_gpu.py            # world 2 (two ranks share a GPU
                                                                       # on a one-GPU machine), 4 with 4 GPUs
The last test runs the same harness on CPU ranks (collective backends) so it is checked everywhere.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from ep_comm.cli.main import NVLS_OFF_DEFAULTS
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .moe_reference import (
    TOLERANCE,
    Layer,
    dense_moe,
    random_tokens,
    rel_err,
    torch_experts_batched,
    torch_experts_standard,
)

STAND_IN = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "examples", "vllm_stand_in")
HIDDEN, FFN, L, MAX_T, TOP_K = 256, 128, 2, 16, 2


def _ngpu() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def import_adapter() -> str:
    """Import ep_comm.integrations.vllm over the real vLLM, or over the stand-in where vLLM is missing
    (only in the test ranks: the pytest process never puts the stand-in on its path).  Returns which."""
    return _stand_in().import_adapter()


def _stand_in():
    """examples/vllm_stand_in, loaded by its path (examples/ is not a package and stays off sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_stand_in", os.path.join(STAND_IN, "__init__.py"),
                                                  submodule_search_locations=[STAND_IN])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _init(use_cuda: bool) -> tuple[int, int, torch.device]:
    """Bootstrap over gloo; on GPUs rank r uses GPU ``r % count`` (two ranks share a GPU when there are
    fewer GPUs than ranks: correct, not fast)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    if not use_cuda:
        return rank, world, torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return rank, world, torch.device("cuda", index)


def run_layer(pf, tok, local: Layer, expert_map, output: torch.Tensor, hooks: bool, rank: int) -> None:
    """One MoE layer the way vLLM's modular kernel runs it, plain-torch experts in the middle."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceDelegate,
        TopKWeightAndReduceNoOP,
    )

    args = (tok.x, tok.weights, tok.ids, pf.cfg.num_experts, expert_map, False, None, False)
    if hooks:
        ret = pf.prepare_async(*args)
        hook, receiver = ret if isinstance(ret, tuple) else (None, ret)
        if hook is not None:
            hook()
        x, _, _, ids, w = receiver()
    else:
        x, _, _, ids, w = pf.prepare(*args)
    if pf.cfg.layout == "batched":
        out, impl = torch_experts_batched(x, local), TopKWeightAndReduceDelegate()
    else:  # with an expert_map the adapter hands out global ids (the experts apply the map)
        offset = rank * L if expert_map is not None else 0
        out, impl = torch_experts_standard(x, ids, w, local, id_offset=offset), TopKWeightAndReduceNoOP()
    if hooks:
        ret = pf.finalize_async(output, out, w, ids, False, impl)
        hook, receiver = ret if isinstance(ret, tuple) else (None, ret)
        if hook is not None:
            hook()
        receiver()
    else:
        pf.finalize(output, out, w, ids, False, impl)


def adapter_rank(backends: tuple[str, ...], graphs: bool) -> dict:
    """Every backend x layout x (hooks off/on) x (eager, and CUDA graphs when ``graphs``)."""
    which = import_adapter()
    import ep_comm
    from ep_comm.integrations.vllm import EPCommPrepareAndFinalize

    rank, world, device = _init(graphs)
    E, dtype = L * world, torch.bfloat16
    layer = Layer.random(E, HIDDEN, FFN, seed=3)
    local = layer.local(rank, L).to(device, dtype)
    expert_map = torch.full((E,), -1, dtype=torch.int32, device=device)
    expert_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32, device=device)
    results: dict = {"_vllm": which}
    for backend in backends:
        for layout in ("standard", "batched"):
            for hooks in (False, True):
                key = f"{backend}/{layout}/{'hooks' if hooks else 'no_hooks'}"
                cfg = ep_comm.EPConfig(num_experts=E, top_k=TOP_K, hidden=HIDDEN, max_tokens_per_rank=MAX_T,
                                       dtype=dtype, layout=layout, backend=backend, timeout_s=60.0)
                try:
                    comm = ep_comm.Communicator(cfg, device=device)
                except (ep_comm.EPTopologyError, ep_comm.EPConfigError) as exc:
                    results[key + "/eager"] = f"skip: {backend} cannot run here: {exc}"
                    if graphs:
                        results[key + "/graph"] = results[key + "/eager"]
                    continue
                with comm:
                    pf = EPCommPrepareAndFinalize(comm)
                    results[key + "/eager"] = _eager(pf, layer, local, expert_map, hooks, rank, world, device)
                    if graphs:
                        results[key + "/graph"] = _graph(pf, layer, local, expert_map, hooks, rank, world, device)
                    if hooks and graphs and not pf.supports_async():
                        results[key + "/eager"].append(f"supports_async() is False on {backend}")
    return results


def _eager(pf, layer, local, expert_map, hooks, rank, world, device) -> list[str]:
    problems = []
    for call in range(3):
        counts = [MAX_T - (r + call) % 5 for r in range(world)]
        if call == 1:
            counts[world - 1] = 0
        mine = random_tokens(counts, HIDDEN, pf.cfg.num_experts, TOP_K, 40 + call, pf.cfg.dtype)[rank].to(device)
        output = torch.empty_like(mine.x)
        run_layer(pf, mine, local, expert_map if pf.cfg.layout == "standard" else None, output, hooks, rank)
        err = rel_err(output, dense_moe(mine, layer))
        if not err <= TOLERANCE[pf.cfg.dtype]:
            problems.append(f"eager call {call} ({counts[rank]} tokens): rel err {err:.3g}")
    return problems


def _graph(pf, layer, local, expert_map, hooks, rank, world, device) -> list[str]:
    """Capture one layer for a fixed token count per rank, replay with fresh tokens."""
    counts = [MAX_T - r for r in range(world)]
    first = random_tokens(counts, HIDDEN, pf.cfg.num_experts, TOP_K, 60, pf.cfg.dtype)[rank].to(device)
    static = type(first)(first.x.clone(), first.ids.clone(), first.weights.clone())
    output = torch.empty_like(static.x)
    emap = expert_map if pf.cfg.layout == "standard" else None
    run_layer(pf, static, local, emap, output, hooks, rank)  # eager warm-up; the expert_map is checked here
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run_layer(pf, static, local, emap, output, hooks, rank)
    problems = []
    pf.reset_expert_load()
    for rep in range(2):
        mine = random_tokens(counts, HIDDEN, pf.cfg.num_experts, TOP_K, 70 + rep, pf.cfg.dtype)[rank].to(device)
        static.x.copy_(mine.x), static.ids.copy_(mine.ids), static.weights.copy_(mine.weights)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_err(output, dense_moe(mine, layer))
        if not err <= TOLERANCE[pf.cfg.dtype]:
            problems.append(f"graph replay {rep}: rel err {err:.3g}")
    if int(pf.expert_load.sum()) == 0:
        problems.append("expert_load did not count during graph replays")
    pf.comms[0].check_errors()
    return problems


def _check(results: list[dict], request_node: str) -> None:
    warnings.warn(f"{request_node}: adapter imported over {results[0]['_vllm']}", UserWarning, stacklevel=2)
    merged: dict[str, list[str]] = {}
    for rank, res in enumerate(results):
        for key, value in res.items():
            if key != "_vllm":
                merged.setdefault(key, [])
                if isinstance(value, str):
                    merged[key] = [value]
                else:
                    merged[key].extend(f"rank {rank}: {p}" for p in value)
    skipped = {k: v[0] for k, v in merged.items() if v and isinstance(v[0], str) and v[0].startswith("skip:")}
    failed = {k: v for k, v in merged.items() if v and k not in skipped}
    assert failed == {}
    if skipped and len(skipped) == len(merged):
        pytest.skip("; ".join(sorted(set(skipped.values()))))
    for key, why in skipped.items():
        warnings.warn(f"{key}: {why}", UserWarning, stacklevel=2)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", ["mnnvl", "nvshmem"])
def test_adapter_on_kernel_backends(world, backend):
    """mnnvl / nvshmem, both formats, eager and CUDA graphs, hooks off and on (world 4 needs 4 GPUs)."""
    if world == 4 and _ngpu() < 4:
        pytest.skip(f"world 4 needs 4 GPUs (found {_ngpu()})")
    results = raise_on_failure(spawn_local(adapter_rank, world, ((backend,), True), timeout_s=600,
                                           extra_env=lambda r: dict(NVLS_OFF_DEFAULTS)))
    _check(results, f"{backend} world {world}")


def test_gpu_harness_on_cpu_ranks():
    """The same rank body on CPU ranks with the collective backends, eager only (keeps the GPU test's
    code checked on machines without GPUs)."""
    results = raise_on_failure(spawn_local(adapter_rank, 2, (("naive", "ag_rs"), False), timeout_s=300,
                                           extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
    _check(results, "CPU harness")
