"""The standard format's per-call work in ``EPCommPrepareAndFinalize`` (id remap, per-expert counts, EPLB
add): the same values as the plain formulas they replace, and a small, fixed number of torch ops with no
host synchronisation (on a GPU every op is a kernel launch, the adapter's eager cost).

Two CPU ranks over the vLLM stand-in, even where vLLM is installed (ranks that import the real vLLM take
half a minute to start; test_vllm.py runs the adapter under vLLM's own kernel).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .test_vllm_gpu import _init, _stand_in

L, MAX_T, TOP_K, HIDDEN = 3, 8, 2, 64
# ops that make no kernel and no copy (views of a tensor)
VIEWS = {"view", "reshape", "_reshape_alias", "expand", "slice", "alias", "as_strided", "detach", "unsqueeze"}
# ops that wait for the device (reading a value on the host) or whose result shape depends on values
SYNCS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "bincount"}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def plain_ids(raw: torch.Tensor, rank: int, world: int, global_ids: bool) -> torch.Tensor:
    """-1 -> a valid id (0, or a peer's first expert with global ids; this rank's own first at world 1)."""
    if not global_ids:
        return raw.clamp_min(0)
    return torch.where(raw >= 0, raw + rank * L, torch.full_like(raw, ((rank + 1) % world) * L))


def plain_counts(raw: torch.Tensor) -> torch.Tensor:
    return torch.stack([(raw == e).sum() for e in range(L)]).to(torch.int32)


def standard_rank() -> dict[str, list[str]]:
    _stand_in().import_adapter(stand_in=True)
    import ep_comm
    from ep_comm.integrations.vllm import EPCommPrepareAndFinalize, _id_table

    rank, world, device = _init(False)
    E = L * world
    problems: dict[str, list[str]] = {}
    # every world size and rank, both id spaces, every local id and -1
    raw = torch.tensor([[-1, 0], [1, -1], [2, 2], [-1, -1]], dtype=torch.int32)
    for w in (1, 2, 3, 4):
        for r in range(w):
            for g in (False, True):
                table = _id_table(r, w, L, 1 << L.bit_length(), g, torch.device("cpu"))
                got = torch.index_select(table, 0, torch.bitwise_and(raw.reshape(-1), table.numel() - 1))
                if not torch.equal(got.view(raw.shape), plain_ids(raw, r, w, g)):
                    problems.setdefault("id table", []).append(f"world {w} rank {r} global {g}: {got.tolist()}")
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[rank * L:(rank + 1) * L] = torch.arange(L, dtype=torch.int32)
    for backend in ("naive", "ag_rs"):
        cfg = ep_comm.EPConfig(num_experts=E, top_k=TOP_K, hidden=HIDDEN, max_tokens_per_rank=MAX_T,
                               dtype=torch.float32, layout="standard", backend=backend, timeout_s=60.0)
        with ep_comm.Communicator(cfg, device=device) as comm:
            for mode in ("local", "global"):
                name = f"{backend}/{mode}"
                bad = problems.setdefault(name, [])
                pf = EPCommPrepareAndFinalize(comm, expert_ids=mode)
                load = torch.zeros(L, dtype=torch.int64)
                for call in range(4):
                    g = torch.Generator().manual_seed(100 * call + rank)
                    t = 0 if call == 1 and rank == 0 else MAX_T - call
                    x = torch.randn(t, HIDDEN, generator=g)
                    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(t)]).to(torch.int32) \
                        if t else torch.empty(0, TOP_K, dtype=torch.int32)
                    ids[torch.rand(ids.shape, generator=g) < 0.2] = -1
                    w = torch.rand(t, TOP_K, generator=g)
                    receiver = pf.prepare_async(x, w, ids, E, expert_map, False, None, False)
                    with _Ops() as ops:  # the adapter's own work on what dispatch received
                        _, _, meta, got_ids, got_w = receiver()
                    d = pf._calls[0].dispatched
                    raw = d.topk_ids
                    counts = meta.expert_num_tokens
                    load += plain_counts(raw)
                    if not torch.equal(got_ids, plain_ids(raw, rank, world, mode == "global")):
                        bad.append(f"call {call}: ids {got_ids.tolist()} from {raw.tolist()}")
                    if got_ids.dtype != torch.int32 or tuple(got_ids.shape) != tuple(raw.shape):
                        bad.append(f"call {call}: ids {got_ids.dtype} {tuple(got_ids.shape)}")
                    if counts.dtype != torch.int32 or not torch.equal(counts, plain_counts(raw)):
                        bad.append(f"call {call}: counts {counts.tolist()} ({counts.dtype}) from {raw.tolist()}")
                    if got_w is not d.topk_weights:
                        bad.append(f"call {call}: weights are not Dispatched.topk_weights")
                    if not torch.equal(pf.expert_load, load):
                        bad.append(f"call {call}: expert_load {pf.expert_load.tolist()}, want {load.tolist()}")
                    kernels = [n for n in ops.names if n not in VIEWS]
                    if len(kernels) > 5 or SYNCS & set(ops.names):
                        bad.append(f"call {call}: {len(kernels)} ops (at most 5, no host sync): {ops.names}")
                    pf.finalize(torch.empty(t, HIDDEN), torch.zeros(d.x.shape), got_w, got_ids, False,
                                _no_op())
    return problems


def _no_op():
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    return TopKWeightAndReduceNoOP()


def test_standard_prepare_values_and_op_budget():
    results = raise_on_failure(spawn_local(standard_rank, 2, (), timeout_s=300,
                                           extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
    failed = {f"rank {rank}: {k}": v for rank, problems in enumerate(results) for k, v in problems.items() if v}
    assert failed == {}
