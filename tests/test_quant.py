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
