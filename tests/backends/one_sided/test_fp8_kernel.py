"""The one-sided dispatch kernel's fused fp8 quantisation is ``ep_comm.quant.quantize_fp8`` byte for byte,
non-finite input included: every token is sent to every rank (own rows and peers' rows, rows split into
pieces by different warps), with rows and blocks across eight decades, values at and beyond +-448 times
the scale, all-zero and negative-zero blocks, and blocks holding a NaN, a +-inf or both, for bf16, fp16
and float32 input; a NaN makes its block NaN (scale 0x7FC00000, bytes 0x7F), a +-inf its block's scale
inf.  mnnvl (both layouts and zero copy) and nvshmem (stores and put mode).  Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.quant import quantize_fp8

from .. import cases
from .quant_checks import assert_clean, cached_run, compare_rows
from .test_nvshmem import PUT, _why_skip

pytestmark = [pytest.mark.gpu]

TOKENS = 6
# one block a row; 2048 channels, sent in pieces of 256; LONG channels on one SM: pieces of 34 and 31
# blocks, so a warp quantises whole steps of 8 blocks, a last step of 2 or 7, and more than the 32 block
# scales it holds before storing them
LONG = 8320
HIDDENS = (128, 2048, LONG)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("standard", "batched", "zero_copy")


def _rows(world: int, hidden: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's x ``[TOKENS, hidden]``: random magnitudes per row and per block, then special rows."""
    g = torch.Generator().manual_seed(seed)
    nb = hidden // 128
    out = []
    for _ in range(world):
        x = torch.randn(TOKENS, hidden, generator=g)
        x *= torch.pow(10.0, torch.rand(TOKENS, 1, generator=g) * 4 - 2)
        per_block = torch.pow(10.0, torch.rand(TOKENS, nb, 1, generator=g) * 4 - 2)
        x *= per_block.expand(TOKENS, nb, 128).reshape(TOKENS, hidden)
        x[0] = 0.0
        x[0, 3] = -0.0
        x[1, 5] = float("nan")  # block 0: NaN
        x[2, 7] = float("inf")  # block 0: inf
        x[2, 9] = -float("inf")
        x[3, 1] = float("nan")  # block 0: NaN and inf
        x[3, 2] = float("-inf")
        x[4, :4] = torch.tensor([448.0, -448.0, 1e-30, -1e-30])  # the block's extremes and flushed values
        if hidden > 1024:  # non-finite blocks in the middle of a step, in the rows' later pieces
            x[1, hidden - 300] = float("nan")
            x[2, hidden // 2 + 200] = float("-inf")
        out.append(x.to(dtype))
    return out


def case_names(backend: str) -> list[str]:
    return [f"{backend}/{layout}/{dt}/h{h}" for layout in LAYOUTS for dt in DTYPES for h in HIDDENS]


def _diff(got_x, got_s, want_x, want_s, src_x) -> str:
    """Where a received row first differs from the reference, with its input block."""
    gs, ws = got_s.view(torch.int32), want_s.view(torch.int32)
    if not torch.equal(gs, ws):
        b = int((gs != ws).nonzero()[0])
        return (f"scale of block {b}: 0x{int(gs[b]) & 0xFFFFFFFF:08x}, reference 0x{int(ws[b]) & 0xFFFFFFFF:08x}; "
                f"block amax {src_x[128 * b: 128 * b + 128].float().abs().max().item()}")
    gx, wx = got_x.view(torch.uint8), want_x.view(torch.uint8)
    i = int((gx != wx).nonzero()[0])
    return f"byte {i}: 0x{int(gx[i]):02x}, reference 0x{int(wx[i]):02x}; element {src_x[i].item()}"


def _one_call(comm, cfg, world: int, rank: int, xs: list[torch.Tensor]) -> list[str]:
    ref = [quantize_fp8(x) for x in xs]
    ids = torch.arange(cfg.num_experts, dtype=torch.int32).repeat(TOKENS, 1)
    w = torch.full((TOKENS, cfg.num_experts), 0.5)
    dev = comm.device
    d = comm.dispatch(xs[rank].to(dev), ids.to(dev), w.to(dev))
    h = cfg.hidden
    if d.x.dtype != torch.float8_e4m3fn or d.x_scales is None or d.x_scales.shape[-1] != h // 128:
        return [f"x {d.x.dtype}, x_scales {None if d.x_scales is None else tuple(d.x_scales.shape)}"]
    torch.cuda.synchronize()
    x, s = d.x.cpu(), d.x_scales.cpu()
    counts = d.expert_num_tokens.cpu() if d.layout == "batched" else None
    problems = compare_rows(d.layout, x, s, counts, ref, xs, TOKENS, _diff)
    # the experts' outputs of non-finite rows are NaN or inf: combine runs for the call protocol only
    comm.combine(oracle.run_experts(cfg, rank, world, d).nan_to_num(0.0, 0.0, 0.0), d)
    torch.cuda.synchronize()
    return problems[:8]


def exact_bytes(backends: tuple[str, ...]) -> dict:
    """Rank body: ``{backend/layout/dtype/hidden: problems}``."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    seed = 70
    for backend in backends:
        for layout in LAYOUTS:
            for dt_name, dtype in DTYPES.items():
                for hidden in HIDDENS:
                    seed += 1
                    key = f"{backend}/{layout}/{dt_name}/h{hidden}"
                    kw: dict = dict(zero_copy=True) if layout == "zero_copy" else {}
                    if hidden == LONG:
                        kw["num_sms"] = 1
                    # every token to every rank: top_k = all experts
                    cfg = cases.make_cfg(world, backend, "standard" if layout == "zero_copy" else layout, "fp8",
                                         max_tokens=TOKENS, hidden=hidden, dtype=dtype, num_experts=2 * world,
                                         top_k=2 * world, **kw)
                    with ep_comm.Communicator(cfg, device=device) as comm:
                        if comm.backend != backend:
                            results[key] = [f"resolved backend {comm.backend}"]
                            continue
                        results[key] = _one_call(comm, cfg, world, rank, _rows(world, hidden, dtype, seed))
    return results


@pytest.mark.parametrize("case", case_names("mnnvl"))
def test_mnnvl_fp8_bytes_equal_the_reference(case):
    assert_clean(cached_run("mnnvl", exact_bytes, ("mnnvl",)), case)


needs_nvshmem = pytest.mark.skipif(bool(_why_skip()), reason=_why_skip() or "-")


@needs_nvshmem
@pytest.mark.multigpu
@pytest.mark.parametrize("case", case_names("nvshmem"))
def test_nvshmem_fp8_bytes_equal_the_reference(case):
    assert_clean(cached_run("nvshmem", exact_bytes, ("nvshmem",), env={}), case)


@needs_nvshmem
@pytest.mark.multigpu
@pytest.mark.parametrize("case", case_names("nvshmem"))
def test_nvshmem_put_mode_fp8_bytes_equal_the_reference(case):
    assert_clean(cached_run("nvshmem_put", exact_bytes, ("nvshmem",), env=PUT), case)
