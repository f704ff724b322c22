"""FP8 (e4m3) per-token, per-128-channel quantisation (docs/design.md §5, the DeepSeek-V3 recipe)."""
from __future__ import annotations

import torch

from .config import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
_INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
_NAN = float("nan")  # a positive quiet NaN: float32 0x7FC00000, e4m3fn 0x7F


def quantize_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` float → ``(q [T, H] float8_e4m3fn, scales [T, H // block] float32)``.

    ``scale = max(amax, 1e-4) / 448`` per token per block; ``x ≈ q.float() * scale``.
    The division by 448 is a multiplication by its float32 reciprocal, written out: torch's CUDA
    kernels do that for a scalar divisor anyway, and doing it on every device keeps CPU and GPU
    results bit-identical (the oracle quantises on the CPU).

    Non-finite input: a NaN makes its block's scale NaN and every byte of the block NaN; a ±inf
    (without NaN) makes the scale inf, the block's finite elements ±0 and its infinite ones NaN.  Every
    NaN is written as the same bytes (scale 0x7FC00000, byte 0x7F) whatever its sign or payload, so
    that the one-sided kernels, which quantise on the fly, give exactly these bytes.
    """
    t, h = x.shape
    blocks = x.float().reshape(t, h // block, block)
    amax = blocks.abs().amax(dim=2).clamp_min(AMAX_FLOOR)
    scales = amax * _INV_FP8_MAX
    q = (blocks / scales.unsqueeze(2)).clamp(-FP8_MAX, FP8_MAX)
    q = torch.where(q.isnan(), _NAN, q).to(FP8_DTYPE).reshape(t, h)
    return q, torch.where(scales.isnan(), _NAN, scales)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of ``quantize_fp8`` up to rounding: float32 ``[..., H]`` from q ``[..., H]`` and scales."""
    shape = q.shape
    blocks = q.float().reshape(*shape[:-1], shape[-1] // block, block)
    return (blocks * scales.float().unsqueeze(-1)).reshape(shape)
