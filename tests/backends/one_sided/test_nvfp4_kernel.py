"""The one-sided dispatch kernel's fused NVFP4 quantisation is ``ep_comm.quant_nvfp4.quantize_nvfp4`` byte
for byte: every token is sent to every rank (own rows and peers' rows, rows split into pieces by
different warps, rows of an odd number of scale bytes), with random rows and blocks across eight
decades, rounding ties, blocks that flush to zero, NaN and ±inf blocks and negative zeros, for bf16,
fp16 and float32 input and three global scales; the delivered layout is uint8 ``[..., hidden / 2]``,
float8_e4m3fn ``[..., hidden / 16]`` and the caller's global scale.  mnnvl (both layouts and zero
copy) and nvshmem (stores and put mode); then CUDA-graph capture with NVFP4 on both backends, each
replay with a new global scale.  The oracle matrix (tests/backends/cases.py ``PAYLOADS``) runs NVFP4
through every other one-sided test.  Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.quant_nvfp4 import nvfp4_global_scale, quantize_nvfp4

from .. import cases
from .quant_checks import assert_clean, cached_run, compare_rows
from .test_nvshmem import PUT, _why_skip

pytestmark = [pytest.mark.gpu]

TOKENS = 6
# 3 scale bytes a row; 1024 payload bytes, sent in pieces of 128; LONG channels on one SM: pieces of
# 4352 and 3968 channels, so a warp quantises whole steps of 64 blocks and last steps of 16 and 56
# (whose scales are not whole 16-byte vectors and bypass the stage)
LONG = 8320
HIDDENS = (48, 2048, LONG)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAYOUTS = ("standard", "batched", "zero_copy")
SCALES = ("one", "computed", "448")
# e2m1's rounding boundaries and extremes: with global scale 1 a block of amax 6 gets block scale 1,
# so these are exact ties
TIES = (6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0)


def _rows(world: int, hidden: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's x ``[TOKENS, hidden]``: random magnitudes per row and per block, then special blocks."""
    g = torch.Generator().manual_seed(seed)
    nb = hidden // 16
    ties = torch.tensor(TIES)
    out = []
    for _ in range(world):
        x = torch.randn(TOKENS, hidden, generator=g)
        x *= torch.pow(10.0, torch.rand(TOKENS, 1, generator=g) * 4 - 2)
        per_block = torch.pow(10.0, torch.rand(TOKENS, nb, 1, generator=g) * 4 - 2)
        x *= per_block.expand(TOKENS, nb, 16).reshape(TOKENS, hidden)
        x[0, :16] = ties
        x[0, 16:32] = ties * 2.0 ** -3  # block scale 0.125: ties again
        x[1, :16] = 0.0
        x[1, 3] = -0.0
        x[1, 16:32] = -0.0
        x[2, :16] = 1e-30  # flushes to zero (bf16/fp32) or is zero (fp16)
        x[2, 16:32] = ties * 2.0 ** -14
        x[3, 5] = float("nan")
        x[3, 20] = float("inf")
        x[3, 40 % hidden] = float("-inf")
        x[4] *= 1e-6
        if hidden > 1024:  # non-finite blocks in the middle of a step, in the rows' later pieces
            x[1, hidden - 300] = float("nan")
            x[2, hidden // 2 + 200] = float("-inf")
        out.append(x.to(dtype))
    return out


def _global_scale(name: str, xs: list[torch.Tensor]) -> torch.Tensor:
    if name == "one":
        return torch.ones(1)
    if name == "448":
        return torch.full((1,), 448.0)
    return nvfp4_global_scale(torch.cat([x.float().reshape(-1) for x in xs]))


def case_names(backend: str) -> list[str]:
    return [f"{backend}/{layout}/{dt}/h{h}/{gs}" for layout in LAYOUTS for dt in DTYPES for h in HIDDENS
            for gs in SCALES]


def _diff(got_x, got_s, want_x, want_s, src_x) -> str:
    """Where a received row first differs from the reference, with its input block."""
    if not torch.equal(got_s.view(torch.uint8), want_s.view(torch.uint8)):
        b = int((got_s.view(torch.uint8) != want_s.view(torch.uint8)).nonzero()[0])
        return (f"scale of block {b}: 0x{int(got_s.view(torch.uint8)[b]):02x}, reference "
                f"0x{int(want_s.view(torch.uint8)[b]):02x}; block {src_x[16 * b: 16 * b + 16].float().tolist()}")
    i = int((got_x != want_x).nonzero()[0])
    return (f"byte {i} (elements {2 * i}, {2 * i + 1}): 0x{int(got_x[i]):02x}, reference 0x{int(want_x[i]):02x}; "
            f"block {src_x[(2 * i) // 16 * 16: (2 * i) // 16 * 16 + 16].float().tolist()}")


def exact_bytes(backends: tuple[str, ...]) -> dict:
    """Rank body: ``{backend/layout/dtype/hidden/global scale: problems}``."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    results: dict[str, list[str]] = {}
    seed = 40
    for backend in backends:
        for layout in LAYOUTS:
            for dt_name, dtype in DTYPES.items():
                for hidden in HIDDENS:
                    kw: dict = dict(zero_copy=True) if layout == "zero_copy" else {}
                    if hidden == LONG:
                        kw["num_sms"] = 1
                    # every token to every rank: top_k = all experts
                    cfg = cases.make_cfg(world, backend, "standard" if layout == "zero_copy" else layout, "nvfp4",
                                         max_tokens=TOKENS, hidden=hidden, dtype=dtype, num_experts=2 * world,
                                         top_k=2 * world, **kw)
                    with ep_comm.Communicator(cfg, device=device) as comm:
                        for gs_name in SCALES:
                            seed += 1
                            key = f"{backend}/{layout}/{dt_name}/h{hidden}/{gs_name}"
                            if comm.backend != backend:
                                results[key] = [f"resolved backend {comm.backend}"]
                                continue
                            results[key] = _one_call(comm, cfg, world, rank, _rows(world, hidden, dtype, seed),
                                                     gs_name)
    return results


def _one_call(comm, cfg, world: int, rank: int, xs: list[torch.Tensor], gs_name: str) -> list[str]:
    gs = _global_scale(gs_name, xs)
    ref = [quantize_nvfp4(x, gs) for x in xs]
    ids = torch.arange(cfg.num_experts, dtype=torch.int32).repeat(TOKENS, 1)
    w = torch.full((TOKENS, cfg.num_experts), 0.5)
    dev = comm.device
    d = comm.dispatch(xs[rank].to(dev), ids.to(dev), w.to(dev), gs.to(dev))
    problems: list[str] = []
    h = cfg.hidden
    if d.x.dtype != torch.uint8 or d.x.shape[-1] != h // 2:
        problems.append(f"x is {d.x.dtype} {tuple(d.x.shape)}, expected uint8 [..., {h // 2}]")
    if d.x_scales is None or d.x_scales.dtype != torch.float8_e4m3fn or d.x_scales.shape != (*d.x.shape[:-1], h // 16):
        got = None if d.x_scales is None else (d.x_scales.dtype, tuple(d.x_scales.shape))
        problems.append(f"x_scales is {got}, expected float8_e4m3fn [..., {h // 16}]")
    if d.x_global_scale is None or d.x_global_scale.shape != (1,) or d.x_global_scale.dtype != torch.float32 \
            or float(d.x_global_scale.cpu()[0]) != float(gs[0]):
        problems.append(f"x_global_scale {d.x_global_scale}, expected {gs}")
    if problems:
        return problems
    torch.cuda.synchronize()
    x, s = d.x.cpu(), d.x_scales.cpu()
    counts = d.expert_num_tokens.cpu() if d.layout == "batched" else None
    problems = compare_rows(d.layout, x, s, counts, ref, xs, TOKENS, _diff)
    comm.combine(oracle.run_experts(cfg, rank, world, d), d)
    torch.cuda.synchronize()
    return problems[:8]


@pytest.mark.parametrize("case", case_names("mnnvl"))
def test_mnnvl_bytes_equal_the_reference(case):
    assert_clean(cached_run("mnnvl", exact_bytes, ("mnnvl",)), case)


needs_nvshmem = pytest.mark.skipif(bool(_why_skip()), reason=_why_skip() or "-")


@needs_nvshmem
@pytest.mark.multigpu
@pytest.mark.parametrize("case", case_names("nvshmem"))
def test_nvshmem_bytes_equal_the_reference(case):
    assert_clean(cached_run("nvshmem", exact_bytes, ("nvshmem",), env={}), case)


@needs_nvshmem
@pytest.mark.multigpu
@pytest.mark.parametrize("case", case_names("nvshmem"))
def test_nvshmem_put_mode_bytes_equal_the_reference(case):
    assert_clean(cached_run("nvshmem_put", exact_bytes, ("nvshmem",), env=PUT), case)


def graph_nvfp4(backend: str) -> dict:
    return cases.graph_capture((backend,), quants=("nvfp4",))


@pytest.mark.parametrize("layout", ("standard", "batched"))
def test_mnnvl_nvfp4_cuda_graph(layout):
    assert_clean(cached_run("mnnvl_graph", graph_nvfp4, "mnnvl"), f"mnnvl/{layout}/nvfp4")


@needs_nvshmem
@pytest.mark.multigpu
@pytest.mark.parametrize("layout", ("standard", "batched"))
def test_nvshmem_nvfp4_cuda_graph(layout):
    assert_clean(cached_run("nvshmem_graph", graph_nvfp4, "nvshmem", env={}), f"nvshmem/{layout}/nvfp4")
