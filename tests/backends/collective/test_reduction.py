"""The collective backends' batched combine partial sums, both torch paths, against float64 loops."""
import pytest
import torch

from ep_comm.backends.collective.packing import GatherHandle
from ep_comm.backends.collective.reduction import combine_partial


def _case(rows: int, k: int, slots: int, hidden: int, p_local: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    expert_out = torch.randn(slots, hidden, generator=g).to(torch.bfloat16)
    dest = torch.randperm(slots, generator=g)[: rows * k].view(rows, k) if rows * k <= slots else \
        torch.randint(0, slots, (rows, k), generator=g)
    away = torch.rand(rows, k, generator=g) > p_local
    dest = torch.where(away, slots + torch.arange(rows).view(-1, 1).expand(rows, k), dest)  # trash rows
    weights = torch.where(away, 0.0, torch.rand(rows, k, generator=g) + 0.05)
    used = torch.zeros(slots, dtype=torch.bool)
    used[dest[~away]] = True
    expert_out[~used] = float("nan")  # padding slots: combine must never read them into a sum
    want = torch.zeros(rows, hidden, dtype=torch.float64)
    for r in range(rows):
        for j in range(k):
            if not away[r, j]:
                want[r] += float(weights[r, j]) * expert_out[dest[r, j]].double()
    handle = GatherHandle([rows], torch.ones(rows, dtype=torch.bool), dest, weights)
    return expert_out.view(2, slots // 2, hidden), handle, want


@pytest.mark.parametrize("p_local", [0.0, 0.15, 0.5, 1.0])
def test_batched_partial_sums_both_paths(p_local):
    expert_out, handle, want = _case(rows=24, k=4, slots=128, hidden=64, p_local=p_local, seed=3)
    flat_out = torch.empty(24, 64)
    combine_partial(expert_out, handle, flat_out)  # CPU: only the local pairs
    torch.testing.assert_close(flat_out.double(), want, rtol=1e-6, atol=1e-6)
    # a strided [world, rows / world, hidden] view (the layout used under CUDA graphs) takes the
    # static-shape path: the same sums
    buf = torch.full((2, 13, 64), 7.0)
    combine_partial(expert_out, handle, buf[:, :12])
    torch.testing.assert_close(buf[:, :12].reshape(24, 64).double(), want, rtol=1e-6, atol=1e-6)
    assert bool((buf[:, 12] == 7.0).all())  # the header rows between the chunks are untouched


def test_batched_partial_sums_without_rows():
    expert_out, handle, _ = _case(rows=0, k=4, slots=16, hidden=8, p_local=0.5, seed=1)
    out = torch.empty(0, 8)
    combine_partial(expert_out, handle, out)
    assert out.shape == (0, 8)
