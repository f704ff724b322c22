"""The eager-only shortcuts of the collective backends agree with the general code they stand in for."""
import random

import pytest
import torch

from ep_comm import EPConfig
from ep_comm.backends.collective.error_counts import ErrorCounts
from ep_comm.backends.collective.invalid_ids import InvalidIds
from ep_comm.backends.collective.packing import Gathered, RoutedBatch, layout_for, pack, unpack
from ep_comm.backends.collective.selection import select_local
from ep_comm.errors import EPError, EPInputError
from ep_comm.routing import sanitize_routing


class _Ctx:
    """What ``select_local`` reads of a BackendContext."""

    def __init__(self, layout: str, rank: int, world: int, experts: int, max_tokens: int, k: int):
        self.cfg = EPConfig(num_experts=experts, top_k=k, hidden=8, max_tokens_per_rank=max_tokens,
                            dtype=torch.bfloat16, layout=layout)
        self.rank, self.num_local_experts = rank, experts // world
        self.capacity = self.cfg.capacity(world)


@pytest.mark.parametrize("layout", ["standard", "batched"])
@pytest.mark.parametrize("stacked", [False, True])
def test_merging_on_the_receiver_equals_sanitizing_on_the_sender(layout, stacked):
    """Eager calls send the caller's ids and merge duplicates while selecting (``merge=True``); graph
    captures sanitize first.  Both must give every rank the same Dispatched."""
    seed = random.SystemRandom().randrange(1 << 31)
    g = torch.Generator().manual_seed(seed)
    world, rows, k, experts = 3, 16, 6, 9  # few experts: many duplicates, -1 slots too
    raw_ids = torch.randint(-1, experts, (world * rows, k), generator=g, dtype=torch.int32)
    weights = torch.rand(world * rows, k, generator=g)
    clean_ids, clean_w, invalid = sanitize_routing(raw_ids, weights, experts)
    assert int(invalid) == 0
    x = torch.randn(world * rows, 8, generator=g).to(torch.bfloat16)

    def gathered(ids, w):
        if stacked:  # the equal-size path hands [world, rows, k] views
            ids, w = ids.view(world, rows, k), w.view(world, rows, k)
        return Gathered(ids=ids, weights=w, x=x, x_scales=None, rows=[rows] * world, headers=None)

    for rank in range(world):
        ctx = _Ctx(layout, rank, world, experts, rows, k)
        got = select_local(ctx, gathered(raw_ids, weights), rows, 0, merge=True)
        want = select_local(ctx, gathered(clean_ids.to(torch.int32), clean_w), rows, 0, merge=False)
        msg = f"seed {seed}, rank {rank}, {layout}"
        assert torch.equal(got.handle.row_valid, want.handle.row_valid), msg
        torch.testing.assert_close(got.handle.local_weights, want.handle.local_weights, msg=msg)
        if layout == "standard":
            assert torch.equal(got.topk_ids, want.topk_ids), msg
            torch.testing.assert_close(got.topk_weights, want.topk_weights, msg=msg)
        else:
            assert torch.equal(got.expert_num_tokens, want.expert_num_tokens), msg
            assert torch.equal(got.handle.dest, want.handle.dest), msg
            n = got.expert_num_tokens.tolist()
            for e in range(ctx.num_local_experts):
                assert torch.equal(got.x[e, : n[e]], want.x[e, : n[e]]), msg


@pytest.mark.parametrize("stacked", [False, True])
def test_invalid_id_report_travels_in_the_headers(stacked):
    """Each rank's out-of-range ids go as -1 and their count reaches every rank through the gathered
    headers; one report is reused by every call."""
    g = torch.Generator().manual_seed(int(stacked))
    world, rows, k, experts = 3, 5, 2, 6
    cpu = torch.device("cpu")
    cfg = EPConfig(num_experts=experts, top_k=k, hidden=8, max_tokens_per_rank=rows, dtype=torch.bfloat16)
    report = InvalidIds(cfg, 0, world, cpu, ErrorCounts(cpu))  # rank 0's, one per communicator
    with pytest.raises(EPError, match="not collected"):
        report.raise_if_any(torch.zeros(rows, k, dtype=torch.int64))
    for bad_ranks in ([1], [], [0, 2]):
        sends, sent_ids, own_ids = [], [], None
        for r in range(world):
            ids = torch.randint(-1, experts, (rows, k), generator=g)
            if r in bad_ranks:
                ids[r, 1], ids[rows - 1, 0] = experts + r, -5
            own_ids = ids if r == 0 else own_ids
            clean, _, merged, count = report.route(ids, torch.rand(rows, k, generator=g), capturing=False,
                                                   validate=True)
            assert int(count) == (2 if r in bad_ranks else 0) and not merged
            batch = RoutedBatch(torch.randn(rows, 8, generator=g).to(torch.bfloat16), None, clean,
                                torch.rand(rows, k, generator=g), 0, None)
            lay = layout_for(batch, rows)
            sends.append(pack(batch, lay, torch.empty(lay.nbytes, dtype=torch.uint8), invalid_ids=count))
            sent_ids.append(torch.where((ids < -1) | (ids >= experts), -1, ids))
        got = unpack(torch.stack(sends) if stacked else sends, [lay] * world)
        report.collect(got.headers)
        if not bad_ranks:
            report.raise_if_any(own_ids)
        elif 0 in bad_ranks:  # this rank's own error names its first bad token
            with pytest.raises(EPInputError, match=r"topk_ids\[0, 1\] = 6 on rank 0"):
                report.raise_if_any(own_ids)
        else:
            with pytest.raises(EPInputError, match=r"peer rank\(s\) \[1\]"):
                report.raise_if_any(own_ids)
        assert torch.equal(got.ids.reshape(world * rows, k), torch.cat(sent_ids).to(torch.int32))


def test_unpack_of_one_stacked_buffer_equals_the_list_path():
    g = torch.Generator().manual_seed(5)
    world, rows, k = 3, 4, 2
    sends = []
    for r in range(world):
        t = rows - r  # padding on some ranks
        batch = RoutedBatch(torch.randn(t, 8, generator=g).to(torch.bfloat16), torch.randn(t, 3, generator=g),
                            torch.randint(-1, 6, (t, k), generator=g), torch.rand(t, k, generator=g), 0, None)
        lay = layout_for(batch, rows)
        sends.append(pack(batch, lay, torch.empty(lay.nbytes, dtype=torch.uint8)))
    layouts = [lay] * world
    a = unpack(sends, layouts)
    b = unpack(torch.stack(sends), layouts)
    for name in ("ids", "weights", "x", "x_scales", "headers"):  # bytes: padding rows are uninitialised
        ta, tb = getattr(a, name), getattr(b, name)
        if name in ("ids", "weights"):  # the stacked path leaves them as [world, rows, k] views
            assert tb.shape == (world, rows, k) and tb.data_ptr() == b.headers.data_ptr() + lay.ids_off + \
                (0 if name == "ids" else lay.w_off - lay.ids_off), name
            tb = tb.reshape(world * rows, k)
        assert ta.shape == tb.shape and ta.dtype == tb.dtype, name
        assert torch.equal(ta.contiguous().view(torch.uint8), tb.contiguous().view(torch.uint8)), name
    assert a.ids.dtype == torch.int32 and a.rows == b.rows == [rows] * world
