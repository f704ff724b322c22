import pytest
import torch

from ep_comm.quant import FP8_DTYPE, dequantize_fp8, quantize_fp8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_roundtrip_and_recipe(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(33, 512, generator=g) * torch.logspace(-3, 2, 33).unsqueeze(1)).to(dtype)
    x[5] = 0  # an all-zero token: amax floor keeps the scale finite
    q, s = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (33, 4)
    # scale recipe, checked block by block with a loop
    for t in (0, 5, 32):
        for b in range(4):
            amax = float(x[t, b * 128:(b + 1) * 128].float().abs().max())
            assert s[t, b].item() == pytest.approx(max(amax, 1e-4) / 448.0, rel=2e-7)
    assert float(q.float().abs().max()) <= 448.0
    back = dequantize_fp8(q, s)
    rel = (back - x.float()).norm() / x.float().norm()
    assert rel < 0.05  # e4m3 has 3 mantissa bits
    assert torch.all(back[5] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gpu_bit_identical_to_cpu(dtype):
    # the oracle quantises on the CPU and compares received fp8 bytes exactly
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(257, 1024, generator=g) * torch.logspace(-4, 3, 257).unsqueeze(1)).to(dtype)
    q_cpu, s_cpu = quantize_fp8(x)
    q_gpu, s_gpu = quantize_fp8(x.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


def _nonfinite_rows(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, generator=g)
    x[0, 3] = float("nan")  # block 0 of row 0
    x[1, 130] = float("inf")  # block 1 of row 1
    x[1, 131] = -float("inf")
    x[2, 7] = -float("nan")  # a NaN with its sign bit set
    x[2, 200] = float("inf")
    x[3, 0] = -0.0
    x[3, 1:128] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_non_finite_policy(dtype):
    x = _nonfinite_rows(dtype)
    q, s = quantize_fp8(x)
    qb, sb = q.view(torch.uint8), s.view(torch.int32)
    nan_scale = 0x7FC00000
    # a NaN: its block's scale and every byte NaN, always the same bits whatever the NaN's sign
    assert sb[0, 0] == nan_scale and bool((qb[0, :128] == 0x7F).all())
    assert sb[2, 0] == nan_scale and bool((qb[2, :128] == 0x7F).all())
    # inf: its block's scale inf, the finite elements +-0 (their sign), the infinite ones NaN
    assert torch.isinf(s[1, 1]) and torch.isinf(s[2, 1])
    assert qb[1, 130] == 0x7F and qb[1, 131] == 0x7F and qb[2, 200] == 0x7F
    finite = torch.ones(128, dtype=torch.bool)
    finite[[2, 3]] = False
    signs = (x[1, 128:].float()[finite] < 0).to(torch.uint8) * 0x80
    assert torch.equal(qb[1, 128:][finite], signs)
    # the other blocks are untouched by their neighbours' non-finite values
    assert bool(torch.isfinite(s[0, 1])) and bool(torch.isfinite(s[1, 0]))
    # zeros: the floor keeps the scale finite and -0 keeps its sign
    assert s[3, 0] == pytest.approx(1e-4 / 448.0) and qb[3, 0] == 0x80 and bool((qb[3, 1:128] == 0).all())


@pytest.mark.gpu
def test_fp8_non_finite_gpu_bit_identical_to_cpu():
    x = _nonfinite_rows(torch.bfloat16)
    q_cpu, s_cpu = quantize_fp8(x)
    q_gpu, s_gpu = quantize_fp8(x.cuda())
    assert torch.equal(s_gpu.cpu().view(torch.int32), s_cpu.view(torch.int32))
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
