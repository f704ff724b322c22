"""The collective backends' layout-selection kernels (``ep_comm::collective_select_local`` and
``collective_scatter_rows``) against the torch path of ``selection.select_local`` they stand in for.

Random gathered tables drawn fresh every run (the seed is in every failure message): -1 slots, repeated
experts in a row, both gather shapes (one ``[world, rows, k]`` stacked view, or concatenated rows),
payloads whose rows are and are not a multiple of 16 bytes, with and without scales; and under CUDA
graph capture.  End to end through naive / ag_rs the NCCL tests (test_gpu_collective.py) use them.
Run on a GPU machine: ``pytest -m gpu tests/backends/collective/test_select_kernel.py``.
"""
import random

import pytest
import torch

from ep_comm.backends.collective import kernels
from ep_comm.backends.collective.packing import Gathered
from ep_comm.backends.collective.selection import select_local

from .test_eager_pieces import _Ctx

pytestmark = [pytest.mark.gpu]


@pytest.fixture(autouse=True)
def _kernels_built():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # on a GPU machine the extension must be built: a missing kernel is a failure, not a skip
    assert kernels.select_unavailable() == "", f"selection kernels unavailable: {kernels.select_unavailable()}"


SHAPES = {  # world, rows per rank, k, experts, payload row shape, payload dtype, scale width
    "small": (3, 16, 6, 9, (8,), torch.bfloat16, 3),
    "deepseek_ep2": (2, 128, 8, 256, (7168,), torch.bfloat16, 0),
    "fp8_scales": (2, 64, 8, 32, (256,), torch.float8_e4m3fn, 2),
    "odd_bytes": (4, 7, 5, 12, (37,), torch.uint8, 0),  # rows not a multiple of 16 bytes
    "k_over_32": (2, 9, 40, 64, (64,), torch.float16, 0),
    "zero_rows": (2, 0, 4, 8, (16,), torch.bfloat16, 1),
}


def _table(name: str, stacked: bool, seed: int):
    world, rows, k, experts, tail, dtype, swidth = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, experts, (world * rows, k), generator=g, dtype=torch.int32)
    weights = torch.rand(world * rows, k, generator=g)
    x = torch.randn(world * rows, *tail, generator=g)
    x = torch.randint(0, 256, x.shape, generator=g, dtype=torch.uint8) if dtype == torch.uint8 else x.to(dtype)
    scales = torch.rand(world * rows, swidth, generator=g) if swidth else None
    ids, weights, x = ids.cuda(), weights.cuda(), x.cuda()
    scales = None if scales is None else scales.cuda()
    if stacked:  # the equal-size gather hands [world, rows, k] views
        ids, weights = ids.view(world, rows, k), weights.view(world, rows, k)
    return world, rows, k, experts, Gathered(ids=ids, weights=weights, x=x, x_scales=scales, rows=[rows] * world,
                                             headers=None)


def _same(got, want, ctx, msg: str) -> None:
    assert torch.equal(got.handle.row_valid, want.handle.row_valid), msg
    torch.testing.assert_close(got.handle.local_weights, want.handle.local_weights, msg=msg)
    if got.layout == "standard":
        assert torch.equal(got.topk_ids, want.topk_ids), msg
        torch.testing.assert_close(got.topk_weights, want.topk_weights, msg=msg)
        assert got.x is want.x, msg
        return
    assert torch.equal(got.expert_num_tokens, want.expert_num_tokens), msg
    assert torch.equal(got.handle.dest, want.handle.dest), msg
    assert got.x.shape == want.x.shape and got.x.dtype == want.x.dtype, msg
    n = got.expert_num_tokens.tolist()
    for e in range(ctx.num_local_experts):  # only the filled slots: padding is unspecified
        assert torch.equal(got.x[e, : n[e]].view(torch.uint8),
                           want.x[e, : n[e]].view(torch.uint8)), f"{msg}, expert {e}"
        if want.x_scales is not None:
            assert torch.equal(got.x_scales[e, : n[e]], want.x_scales[e, : n[e]]), f"{msg}, expert {e} scales"


@pytest.mark.parametrize("layout", ["standard", "batched"])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_equal_the_torch_path(shape, stacked, layout):
    seed = random.SystemRandom().randrange(1 << 31)
    world, rows, k, experts, g = _table(shape, stacked, seed)
    for rank in range(world):
        ctx = _Ctx(layout, rank, world, experts, max(rows, 1), k)
        got = select_local(ctx, g, rows, 0, merge=True, kernel=True)
        want = select_local(ctx, g, rows, 0, merge=True, kernel=False)
        torch.cuda.synchronize()
        _same(got, want, ctx, f"seed {seed}, {shape}, stacked={stacked}, rank {rank}, {layout}")


@pytest.mark.parametrize("layout", ["standard", "batched"])
def test_kernels_under_cuda_graph_capture(layout):
    """Captured once, replayed on new routing in the same static tensors: equal to eager selection."""
    seed = random.SystemRandom().randrange(1 << 31)
    world, rows, k, experts, g = _table("small", True, seed)
    ctx = _Ctx(layout, 1, world, experts, rows, k)
    select_local(ctx, g, rows, 0, kernel=True)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select_local(ctx, g, rows, 0, kernel=True)
    for replay in range(3):
        _, _, _, _, fresh = _table("small", True, seed + 1 + replay)
        for dst, src in ((g.ids, fresh.ids), (g.weights, fresh.weights), (g.x, fresh.x), (g.x_scales, fresh.x_scales)):
            dst.copy_(src)
        graph.replay()
        want = select_local(ctx, g, rows, 0, merge=True, kernel=False)
        torch.cuda.synchronize()
        _same(captured, want, ctx, f"seed {seed}, replay {replay}, {layout}")
