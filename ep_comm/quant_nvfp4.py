"""NVFP4: e2m1 values, an e4m3 scale per 16 channels and a float32 global scale per tensor
(docs/design.md §5).  The reference every backend and kernel is checked against.

The recipe, in float32 steps a CUDA kernel reproduces exactly (IEEE multiply and divide, no
approximate reciprocals, no fused multiply-add across steps), for ``x [T, H]`` with ``H % 16 == 0``:

1. ``gs``: the caller's global scale (float32, the same on every rank), or, when none is given,
   ``2688 / max(amax, 1e-4)`` with ``amax`` the largest finite ``|x|`` of the tensor
   (``2688 = 6 * 448``: e2m1's largest value times e4m3's, so no block scale saturates).
2. per 16-channel block ``b``: ``amax_b = max |x|`` (NaN if the block holds a NaN);
   ``s_b = (amax_b * fl32(1/6)) * gs``; the block scale ``sf_b = e4m3(min(s_b, 448))``, rounded to
   nearest, ties to even (NaN stays NaN: 0x7F).
3. ``os_b = gs / sf_b`` (0 where ``sf_b == 0`` or NaN); each element ``q = x * os_b``, NaN taken as 0,
   encoded as e2m1 rounded to nearest, ties to even, saturating at ±6; the sign bit is the float's
   (so -0.0 and negatives that round to zero encode as 0x8).
4. packing: byte ``i`` of a row holds element ``2i`` in its low nibble and ``2i + 1`` in its high one.

Dequantised: ``x̂ = (e2m1(code) * sf_b) / gs``; the product is exact in float32, so ``x̂`` is the
correctly rounded value the code stands for.  Within range (``amax_b * gs <= 2688``) every element is
within half of e2m1's widest gap of it, ``|x̂ - x| <= amax_b / 6`` up to the block scale's own
rounding (``nvfp4_tolerance`` allows either e4m3 neighbour).  Blocks flush to zero when
``s_b <= 2**-10``: with the computed global scale, blocks about 4.6e5 times smaller than the tensor's
amax.

NaN and inf are not checked for (that would cost a device-to-host sync per call); they follow the
recipe: a NaN makes its whole block's scale NaN, so the block dequantises to NaN and no other block is
touched; ±inf saturates its block's scale to 448 and itself to ±6, so it comes back as
``±6 * 448 / gs``; the computed global scale ignores non-finite values.

``swizzle_nvfp4_scales`` lays linear block scales out in the 128x4 tiles that Blackwell block-scaled
GEMMs read (cuBLAS's "1D block scaling factors layout", FlashInfer's ``nvfp4_block_scale_interleave``).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .config import NVFP4_BLOCK

E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_DTYPE = torch.float8_e4m3fn
GLOBAL_SCALE_NUMERATOR = E2M1_MAX * E4M3_MAX  # 2688
AMAX_FLOOR = 1e-4
_INV_E2M1_MAX = float(torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32))
# rounding boundaries of e2m1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: a tie goes to the even code,
# so a boundary above an even code is passed only strictly (>) and one above an odd code inclusively (>=)
_STRICT = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE = (0.75, 1.75, 3.5)
TILE_ROWS, TILE_COLS = 128, 4  # one tile: 128 rows x 4 scale columns = 512 bytes

GlobalScale = Union[torch.Tensor, float]


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[1]`` on ``x``'s device: ``2688 / max(amax, 1e-4)`` over the finite elements of ``x``
    (any shape, any float dtype).  No host sync."""
    a = x.detach().float().abs()
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    amax = a.amax().clamp_min(AMAX_FLOOR) if a.numel() else torch.full((), AMAX_FLOOR, device=x.device)
    # a tensor divided by a tensor: one IEEE division (a number divided by a tensor is a reciprocal
    # and a multiplication in torch, two roundings)
    return (torch.full_like(amax, GLOBAL_SCALE_NUMERATOR) / amax).reshape(1)


def _as_global_scale(global_scale: Optional[GlobalScale], x: torch.Tensor) -> torch.Tensor:
    if global_scale is None:
        return nvfp4_global_scale(x)
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(f"global_scale must hold one value, got shape {tuple(global_scale.shape)}")
        return global_scale.reshape(1).to(device=x.device, dtype=torch.float32)
    return torch.tensor([float(global_scale)], dtype=torch.float32, device=x.device)


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes (sign in bit 3) of float32 ``q`` rounded to e2m1: nearest, ties to even, saturating
    at ±6; NaN encodes as +0."""
    q = torch.where(torch.isnan(q), torch.zeros_like(q), q)
    a = q.abs()
    code = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for b in _STRICT:
        code += (a > b).to(torch.uint8)
    for b in _INCLUSIVE:
        code += (a >= b).to(torch.uint8)
    return code | (torch.signbit(q).to(torch.uint8) << 3)


def e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 e2m1 codes (only the low 4 bits are read).  Arithmetic, no lookup
    table: a table built on the host would be a host-to-device copy, illegal inside a CUDA graph."""
    c = code.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).to(torch.float32)
    power = (e == 1).to(torch.float32) + 2.0 * (e == 2).to(torch.float32) + 4.0 * (e == 3).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, power * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``[..., H // 16]``: step 2 of the recipe for ``x [..., H]`` and float32 ``gs [1]``."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # NaN propagates: a NaN poisons its block's scale
    s = (amax * _INV_E2M1_MAX) * global_scale
    return s.clamp(max=E4M3_MAX).to(SCALE_DTYPE)  # satfinite: inf -> 448, NaN stays NaN


def quantize_nvfp4(x: torch.Tensor, global_scale: Optional[GlobalScale] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [T, H]`` bf16/fp16/fp32, ``H % 16 == 0`` → ``(packed, scales, gs)``.

    ``packed``: uint8 ``[T, H // 2]`` (two e2m1 codes per byte, even element in the low nibble);
    ``scales``: float8_e4m3fn ``[T, H // 16]``, linear (row ``t``'s blocks in channel order);
    ``gs``: float32 ``[1]``, ``global_scale`` as given (a float or a one-element tensor) or computed
    from ``x`` (``nvfp4_global_scale``).  The recipe is the module's; no host sync.
    """
    if x.dim() != 2 or x.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"quantize_nvfp4 needs x [T, H] with H % {NVFP4_BLOCK} == 0, got {tuple(x.shape)}")
    t, h = x.shape
    gs = _as_global_scale(global_scale, x)
    scales = block_scales(x, gs)
    sf = scales.float()
    out_scale = torch.where(sf > 0, gs / sf, torch.zeros_like(sf))  # NaN scale: 0 (its block stays NaN)
    q = x.float().reshape(t, h // NVFP4_BLOCK, NVFP4_BLOCK) * out_scale.unsqueeze(-1)
    codes = e2m1_codes(q).reshape(t, h)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scales, gs


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., 2W]`` from packed bytes ``[..., W]``."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: GlobalScale) -> torch.Tensor:
    """float32 ``[..., H]`` from uint8 ``packed [..., H // 2]``, float8_e4m3fn (or its uint8 bytes)
    ``scales [..., H // 16]`` in the linear layout, and the global scale: ``(e2m1 * sf) / gs``."""
    values = e2m1_values(unpack_e2m1(packed))
    h = values.shape[-1]
    if scales.dtype == torch.uint8:
        scales = scales.view(SCALE_DTYPE)
    sf = scales.float().unsqueeze(-1)
    gs = _as_global_scale(global_scale, values)
    blocks = values.reshape(*values.shape[:-1], h // NVFP4_BLOCK, NVFP4_BLOCK)
    return ((blocks * sf) / gs).reshape(values.shape)


def nvfp4_tolerance(x: torch.Tensor, global_scale: GlobalScale) -> torch.Tensor:
    """float32 ``[..., H]``: how far a dequantised element may lie from the original ``x [..., H]``.

    ``amax_b * (1 + 2**-3) / 6 + 6 * 2**-9 / gs`` per block: half of e2m1's widest gap (4 to 6, a third
    of its range) at the block's scale, which is ``amax_b / 6``, with the block scale allowed to be
    either e4m3 value around ``amax_b * gs / 6`` (within 2**-3 relative, or 2**-9 absolute in e4m3's
    subnormal range, which also covers blocks flushed to zero).  So a quantiser whose float arithmetic
    differs from the reference (the other scale neighbour, ties within float32 noise rounded the other
    way) stays within it; a value rounded to a non-adjacent code or a scale two steps off does not.
    Holds for blocks in range (``amax_b * gs <= 2688``), plus float32 rounding of the dequantised value
    (``2**-20 * |x|``).
    """
    xf = x.float()
    gs = _as_global_scale(global_scale, xf)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK).abs()
    amax = blocks.amax(dim=-1, keepdim=True)
    tol = amax * ((1.0 + 2.0 ** -3) / E2M1_MAX) + (E2M1_MAX * 2.0 ** -9) / gs + blocks * 2.0 ** -20
    return tol.reshape(xf.shape)


# -- the 128x4 scale layout ---------------------------------------------------------------------------
def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def swizzle_nvfp4_scales(scales: torch.Tensor) -> torch.Tensor:
    """Linear block scales ``[M, S]`` (or ``[B, M, S]``, each of the ``B`` matrices on its own, e.g. one
    per local expert of the batched layout) → the 128x4 tiled layout, float8_e4m3fn
    ``[pad128(M), pad4(S)]`` (``[B, pad128(M), pad4(S)]``), padding zero.

    Only the bytes' order means anything: scale ``(m, k)`` sits at flat offset
    ``((m // 128) * (pad4(S) // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4``
    of its matrix (tiles of 128 rows x 4 columns in row-major tile order; inside a tile, row ``m``'s
    four columns are contiguous, rows 32 apart interleaved).  This is the layout FlashInfer's
    ``nvfp4_block_scale_interleave`` and ``fp4_quantize(is_sf_swizzled_layout=True)`` produce.
    """
    batched = scales.dim() == 3
    if scales.dim() not in (2, 3):
        raise ValueError(f"swizzle_nvfp4_scales needs [M, S] or [B, M, S] scales, got {tuple(scales.shape)}")
    s = scales if batched else scales.unsqueeze(0)
    b, m, k = s.shape
    mp, kp = _padded(m, TILE_ROWS), _padded(k, TILE_COLS)
    raw = torch.zeros(b, mp, kp, dtype=torch.uint8, device=s.device)
    raw[:, :m, :k] = s.view(torch.uint8) if s.dtype != torch.uint8 else s
    # row m = tile * 128 + group * 32 + lane, column k = ktile * 4 + kk  →  [tile, ktile, lane, group, kk]
    tiles = raw.view(b, mp // TILE_ROWS, 4, 32, kp // TILE_COLS, TILE_COLS).permute(0, 1, 4, 3, 2, 5)
    out = tiles.contiguous().view(b, mp, kp).view(SCALE_DTYPE)
    return out if batched else out[0]


def unswizzle_nvfp4_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of ``swizzle_nvfp4_scales``: the linear ``[rows, cols]`` (``[B, rows, cols]``) float8_e4m3fn
    scales out of ``[pad128(rows), pad4(cols)]`` (``[B, ...]``) tiled ones."""
    batched = swizzled.dim() == 3
    s = swizzled if batched else swizzled.unsqueeze(0)
    b = s.shape[0]
    mp, kp = _padded(rows, TILE_ROWS), _padded(cols, TILE_COLS)
    if tuple(s.shape[1:]) != (mp, kp):
        raise ValueError(f"swizzled scales of shape {tuple(swizzled.shape)} do not hold [{rows}, {cols}] "
                         f"(expected [..., {mp}, {kp}])")
    raw = s.contiguous().view(torch.uint8).view(b, mp // TILE_ROWS, kp // TILE_COLS, 32, 4, TILE_COLS)
    linear = raw.permute(0, 1, 4, 3, 2, 5).contiguous().view(b, mp, kp)[:, :rows, :cols].view(SCALE_DTYPE)
    return linear if batched else linear[0]
