"""quant="nvfp4" is fused into the one-sided kernels: mnnvl and nvshmem no longer refuse it, so their
availability says only what the machine lacks (here: CUDA or the build), ``backend="auto"`` on CPU ranks
still takes a collective backend, and on a GPU node mnnvl is available with NVFP4 as without it."""
from __future__ import annotations

import types

import pytest
import torch

import ep_comm
from ep_comm.backends.one_sided.backend import FUSED_QUANT, quant_unsupported
from ep_comm.backends.one_sided.mnnvl import MnnvlBackend
from ep_comm.backends.one_sided.nvshmem import NvshmemBackend
from ep_comm.config import QUANT_MODES
from ep_comm.distributed.spawn import raise_on_failure, spawn_local


def _cfg(**kw) -> ep_comm.EPConfig:
    base = dict(num_experts=4, top_k=2, hidden=64, max_tokens_per_rank=4, quant="nvfp4")
    base.update(kw)
    return ep_comm.EPConfig(**base)


def test_every_quant_mode_is_fused():
    assert set(FUSED_QUANT) == set(QUANT_MODES)
    assert all(quant_unsupported(q) == "" for q in QUANT_MODES)
    assert "not fused" in quant_unsupported("int4")


def test_availability_does_not_name_the_quantisation():
    ctx = types.SimpleNamespace(cfg=_cfg(), device=torch.device("cpu"), num_local_experts=2)
    for backend in (MnnvlBackend, NvshmemBackend):
        a = backend.availability(ctx)
        assert not a.ok and a.reason and "nvfp4" not in a.reason, a


def _choice_worker() -> dict:
    ep_comm.init_distributed()
    out = {}
    for layout in ("standard", "batched"):
        with ep_comm.Communicator(_cfg(layout=layout)) as comm:
            out[f"auto/{layout}"] = comm.backend
    try:
        ep_comm.Communicator(_cfg(backend="mnnvl")).close()
        out["mnnvl"] = "created"
    except ep_comm.EPTopologyError as exc:
        out["mnnvl"] = str(exc)
    return out


def test_auto_on_cpu_ranks_takes_a_collective_backend():
    for res in raise_on_failure(spawn_local(_choice_worker, 2, timeout_s=120,
                                            extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""})):
        assert res["auto/standard"] == "ag_rs" and res["auto/batched"] == "ag_rs", res
        assert "backend 'mnnvl' cannot run" in res["mnnvl"] and "nvfp4" not in res["mnnvl"], res


@pytest.mark.gpu
def test_available_on_a_gpu_node():
    from ep_comm.backends.base import BackendContext
    from ep_comm.distributed.topology import Topology

    # two ranks on this host, as a communicator on a GPU node sees them
    topo = Topology(rank=0, world_size=2, local_rank=0, local_world_size=2, host_id="h", node_rank=0,
                    ranks_by_host={"h": (0, 1)}, device_index=0)

    def ctx(quant):
        return BackendContext(_cfg(backend="mnnvl", quant=quant), None, None, topo, 0, 2,  # type: ignore[arg-type]
                              torch.device("cuda", 0))

    plain = MnnvlBackend.availability(ctx(None))
    assert plain.ok, plain
    assert MnnvlBackend.availability(ctx("nvfp4")) == plain
