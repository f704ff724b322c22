"""The one-sided kernels do not quantise to NVFP4 yet: mnnvl and nvshmem say so through
``availability``, before anything about the device is asked, so ``backend="auto"`` takes a collective
backend and a named one raises EPTopologyError with that reason, on a laptop as on a GPU node."""
from __future__ import annotations

import types

import pytest

import ep_comm
from ep_comm.backends.one_sided.backend import quant_unsupported
from ep_comm.backends.one_sided.mnnvl import MnnvlBackend
from ep_comm.backends.one_sided.nvshmem import NvshmemBackend
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

REASON = "quant='nvfp4' is not fused into the one-sided kernels yet"


def _cfg(**kw) -> ep_comm.EPConfig:
    base = dict(num_experts=4, top_k=2, hidden=64, max_tokens_per_rank=4, quant="nvfp4")
    base.update(kw)
    return ep_comm.EPConfig(**base)


def test_availability_names_the_missing_fusion_first():
    assert quant_unsupported(None) == "" and quant_unsupported("fp8") == ""
    assert REASON in quant_unsupported("nvfp4")
    # the refusal comes before any device or build question: a context with nothing but the config will do
    ctx = types.SimpleNamespace(cfg=_cfg())
    for backend in (MnnvlBackend, NvshmemBackend):
        a = backend.availability(ctx)
        assert not a.ok and a.reason.startswith(REASON), a


def _choice_worker() -> dict:
    ep_comm.init_distributed()
    out = {}
    for layout in ("standard", "batched"):
        with ep_comm.Communicator(_cfg(layout=layout)) as comm:
            out[f"auto/{layout}"] = comm.backend
    for name in ("mnnvl", "nvshmem"):
        try:
            ep_comm.Communicator(_cfg(backend=name)).close()
            out[name] = "created"
        except ep_comm.EPTopologyError as exc:
            out[name] = str(exc)
    return out


def test_auto_takes_a_collective_backend_and_a_named_one_says_why():
    for res in raise_on_failure(spawn_local(_choice_worker, 2, timeout_s=120,
                                            extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""})):
        assert res["auto/standard"] == "ag_rs" and res["auto/batched"] == "ag_rs", res
        for name in ("mnnvl", "nvshmem"):
            msg = res[name]
            assert f"backend {name!r} cannot run" in msg and REASON in msg, msg
            assert msg.count(REASON) == 1 and "rank" not in msg.split(REASON)[0], msg  # said once for both ranks
            assert "'ag_rs'" in msg and "'naive'" in msg, msg  # what would work


@pytest.mark.gpu
def test_refused_on_a_gpu_node_too():
    import torch

    from ep_comm.backends.base import BackendContext

    cfg = _cfg(backend="mnnvl")
    ctx = BackendContext(cfg, None, None, None, 0, 2, torch.device("cuda", 0))  # type: ignore[arg-type]
    a = MnnvlBackend.availability(ctx)
    assert not a.ok and a.reason.startswith(REASON)
