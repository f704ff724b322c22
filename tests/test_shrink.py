"""The single-process pieces of ``Communicator.shrink``: ``routing.count_inactive_pairs`` against the
oracle's loop count, ``BackendContext``'s view of the active ranks, the oracle with ``active_ranks``
and the base ``Backend.shrink`` refusal.  The multi-process kill / shrink / go on runs are in
tests/backends/collective/test_shrink.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.backends.base import Backend, BackendContext
from ep_comm.errors import EPError
from ep_comm.routing import count_inactive_pairs


def _cfg(world: int = 4) -> ep_comm.EPConfig:
    return ep_comm.EPConfig(num_experts=3 * world, top_k=4, hidden=8, max_tokens_per_rank=32, dtype=torch.float32,
                            layout="standard", backend="naive")


def _ctx(world: int = 4, rank: int = 1, active: tuple[int, ...] = ()) -> BackendContext:
    # control/topology are not used by the helpers under test
    return BackendContext(cfg=_cfg(world), group=None, control=None, topology=None,  # type: ignore[arg-type]
                          rank=rank, world_size=world, device=torch.device("cpu"), active_ranks=active)


@pytest.mark.parametrize("seed", range(6))
def test_count_inactive_pairs_matches_the_oracle(seed: int) -> None:
    cfg, world = _cfg(), 4
    active = sorted(torch.randperm(world, generator=torch.Generator().manual_seed(seed))[: 1 + seed % 3].tolist())
    inputs = oracle.random_inputs(cfg, world, seed, p_minus_one=0.2, p_duplicate=0.3)
    ctx = _ctx(world, rank=active[0], active=tuple(active))
    want = oracle.expected_inactive_pairs(cfg, inputs, active)
    for r, inp in enumerate(inputs):
        got = count_inactive_pairs(inp.topk_ids, ctx.expert_active)
        assert got.dim() == 0 and got.dtype == torch.int64
        assert int(got) == want[r]


def test_count_inactive_pairs_merges_duplicates_and_skips_invalid_ids() -> None:
    active = torch.tensor([True, True, False, False])
    ids = torch.tensor([[2, 2, 3, -1], [0, 5, -7, 2], [-1, -1, -1, -1]])
    assert int(count_inactive_pairs(ids, active)) == 3  # (0, 2), (0, 3), (1, 2)
    assert int(count_inactive_pairs(ids[:0], active)) == 0
    assert int(count_inactive_pairs(ids[:, :1].to(torch.int32), active)) == 1


def test_backend_context_over_survivors() -> None:
    full = _ctx(4, rank=2)
    assert full.active_ranks == (0, 1, 2, 3) and full.is_full and full.group_rank == 2 and full.group_size == 4
    assert bool(full.expert_active.all())
    ctx = dataclasses.replace(full, active_ranks=(0, 2, 3))
    assert not ctx.is_full and ctx.group_rank == 1 and ctx.group_size == 3
    assert ctx.num_local_experts == 3 and ctx.capacity == 4 * 32  # the original placement
    assert ctx.expert_active.tolist() == [True] * 3 + [False] * 3 + [True] * 6
    assert [ctx.owner_of(e) for e in (0, 3, 11)] == [0, 1, 3]
    with pytest.raises(EPError, match="not among the active ranks"):
        _ctx(4, rank=1, active=(0, 2))
    with pytest.raises(EPError, match="ascending distinct"):
        _ctx(4, rank=0, active=(0, 4))


def test_oracle_without_the_experts_of_inactive_ranks() -> None:
    cfg, world, active = _cfg(), 4, (0, 3)
    inputs = oracle.random_inputs(cfg, world, 5, p_duplicate=0.2)
    L = cfg.num_experts // world
    full = oracle.expected_dispatch(cfg, inputs)
    part = oracle.expected_dispatch(cfg, inputs, active)
    assert not part[1].rows and not part[2].rows  # inactive ranks receive nothing
    for r in active:  # an active rank receives only the active ranks' tokens, and only for its experts
        assert sum(map(len, part[r].rows.values())) < sum(map(len, full[r].rows.values()))
    y_full = oracle.expected_combine(cfg, inputs)
    y_part = oracle.expected_combine(cfg, inputs, active_ranks=active)
    only_active = oracle.expected_combine(cfg, inputs,
                                          lambda xf, e: oracle.test_expert(xf, e) * float(e // L in active))
    for r in range(world):
        torch.testing.assert_close(y_part[r], only_active[r])
    assert not torch.equal(y_part[0], y_full[0])


def test_base_backend_cannot_shrink() -> None:
    class Stub(Backend):
        name = "stub"
        availability = create = capabilities = dispatch = combine = check_errors = close = None  # type: ignore
        dispatch_input_buffer = expert_output_buffer = None  # type: ignore

    with pytest.raises(EPError, match="backend stub cannot shrink"):
        Backend.shrink(object.__new__(Stub), _ctx())
