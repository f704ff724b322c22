"""The eager-only shortcuts of the collective backends agree with the general code they stand in for."""
import random

import pytest
import torch

from ep_comm.backends import RoutedBatch
from ep_comm.backends.gathered import ids_in_range, layout_for, merge_duplicates, pack, unpack
from ep_comm.routing import sanitize_routing


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_merge_duplicates_matches_sanitize_routing(dtype):
    seed = random.SystemRandom().randrange(1 << 31)
    g = torch.Generator().manual_seed(seed)
    t, k, experts = 64, 6, 9  # few experts: many duplicates
    ids = torch.randint(-1, experts, (t, k), generator=g).to(dtype)
    weights = torch.rand(t, k, generator=g)
    want_ids, want_w, invalid = sanitize_routing(ids, weights, experts)
    got_ids, got_w = merge_duplicates(ids, weights)
    assert int(invalid) == 0
    assert got_ids.dtype == dtype and torch.equal(got_ids.to(torch.int64), want_ids), f"seed {seed}"
    torch.testing.assert_close(got_w, want_w, msg=lambda m: f"seed {seed}: {m}")


def test_ids_in_range():
    assert ids_in_range(torch.empty(0, 4, dtype=torch.int64), 8)
    assert ids_in_range(torch.tensor([[-1, 0], [7, 3]]), 8)
    assert not ids_in_range(torch.tensor([[-2, 0]]), 8)
    assert not ids_in_range(torch.tensor([[0, 8]], dtype=torch.int32), 8)


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
