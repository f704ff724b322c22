"""The NVFP4 reference quantiser (ep_comm/quant_nvfp4.py) against a float64 rendering of its recipe,
written here independently: e4m3 and e2m1 rounding by explicit search over each format's values."""
import math

import pytest
import torch

from ep_comm.quant_nvfp4 import (
    SCALE_DTYPE,
    dequantize_nvfp4,
    e2m1_codes,
    e2m1_values,
    nvfp4_global_scale,
    nvfp4_tolerance,
    quantize_nvfp4,
    swizzle_nvfp4_scales,
    unswizzle_nvfp4_scales,
)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # code 0..7
# every non-negative finite e4m3fn value: subnormals m * 2**-9, normals (1 + m/8) * 2**(e - 7)
E4M3 = [m * 2.0 ** -9 for m in range(8)] + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
E4M3 = [v for v in E4M3 if v <= 448.0]


def _nearest_even(value: float, grid: list[float]) -> int:
    """Index of the grid value nearest to ``value`` (non-negative), ties to the even index; saturating."""
    if value >= grid[-1]:
        return len(grid) - 1
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - value), i % 2))
    return best


def _e4m3_64(v: float) -> float:
    return E4M3[_nearest_even(v, E4M3)]


def _reference64(x: torch.Tensor, gs: float) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Per element the e2m1 code, per block the e4m3 scale, computed in float64; and per block the exact
    s = amax/6*gs (to tell where float32 arithmetic may round the other way)."""
    codes, scales, raw = [], [], []
    for row in x.double().tolist():
        rc, rs, rr = [], [], []
        for b in range(0, len(row), 16):
            block = row[b: b + 16]
            s = max(abs(v) for v in block) / 6.0 * gs
            sf = _e4m3_64(s)
            rs.append(sf)
            rr.append(s)
            for v in block:
                q = v * gs / sf if sf else v * 0.0  # the sign survives a zero scale
                c = _nearest_even(abs(q), E2M1)
                rc.append(c | (8 if math.copysign(1.0, q) < 0 else 0))
        codes.append(rc)
        scales.append(rs)
        raw.append(rr)
    return codes, scales, raw


def _near_tie(v: float, grid: list[float], rel: float) -> bool:
    """``v`` lies within ``rel`` (relative) of a midpoint of ``grid``, where float32 rounding may tip it."""
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    return any(abs(v - m) <= rel * max(m, 1e-30) for m in mids)


def _codes(packed: torch.Tensor) -> list[list[int]]:
    low, high = (packed & 0xF).tolist(), (packed >> 4).tolist()
    return [[c for pair in zip(lo, hi) for c in pair] for lo, hi in zip(low, high)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_a_float64_reference_of_the_recipe(dtype):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(24, 256, generator=g) * torch.logspace(-2, 2, 24).unsqueeze(1)).to(dtype)
    packed, scales, gs = quantize_nvfp4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 128)
    assert scales.dtype == SCALE_DTYPE and scales.shape == (24, 16)
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert float(gs) == pytest.approx(2688.0 / float(x.float().abs().max()), rel=1e-6)
    codes64, scales64, raw64 = _reference64(x, float(gs))
    got_codes, got_scales = _codes(packed), scales.float().tolist()
    checked = differ = 0
    for t in range(24):
        for b in range(16):
            if got_scales[t][b] != scales64[t][b]:
                # only where float32's rounding of s can land on the other side of an e4m3 midpoint
                assert _near_tie(raw64[t][b], E4M3, 2.0 ** -22), (t, b, raw64[t][b])
                differ += 1
                continue
            for i in range(b * 16, b * 16 + 16):
                checked += 1
                if got_codes[t][i] != codes64[t][i]:
                    q = float(x[t, i]) * float(gs) / scales64[t][b]
                    assert _near_tie(abs(q), E2M1, 2.0 ** -21), (t, i, q)
                    differ += 1
    assert checked >= 24 * 256 * 0.99 and differ <= checked * 1e-3


def test_bit_exact_where_every_step_is_exact_ties_included():
    """Power-of-two global scale and values on the e2m1 grid and its midpoints: every float32 step of
    the recipe is exact, so the codes (round half to even) and scales must equal the reference."""
    gs = 2.0 ** 5
    unit = 2.0 ** -3  # the block scale after e4m3 rounding is unit * gs = 4: amax = 6 * unit
    grid = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, -0.75]
    x = torch.tensor([[v * unit for v in grid]], dtype=torch.float32)
    packed, scales, _ = quantize_nvfp4(x, gs)
    assert float(scales[0, 0]) == 4.0
    want = [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 8 | 2]  # ties go to the even code
    assert _codes(packed)[0] == want
    codes64, scales64, _ = _reference64(x, gs)
    assert codes64[0] == want and scales64[0] == [4.0]
    assert dequantize_nvfp4(packed, scales, gs)[0].tolist() == [E2M1[c & 7] * (-1 if c & 8 else 1) * unit
                                                                 for c in want]


def test_e2m1_codes_and_values_round_trip_every_code():
    values = e2m1_values(torch.arange(16, dtype=torch.uint8))
    assert values.tolist() == E2M1 + [-v for v in E2M1]
    assert e2m1_codes(values).tolist() == list(range(16))
    assert e2m1_codes(torch.tensor([7.0, 100.0, float("inf"), -9.0, float("nan")])).tolist() == [7, 7, 7, 15, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_within_the_stated_tolerance(dtype):
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(40, 512, generator=g) * torch.logspace(-3, 3, 40).unsqueeze(1)).to(dtype)
    packed, scales, gs = quantize_nvfp4(x)
    back = dequantize_nvfp4(packed, scales, gs)
    err = (back - x.float()).abs()
    assert bool((err <= nvfp4_tolerance(x, gs)).all())
    # the bound is not loose: errors reach a good part of it, and the typical error is e2m1's
    assert float((err / nvfp4_tolerance(x, gs)).max()) > 0.5
    big = x.float().abs() > 1.0  # rows well inside the range, away from e4m3's subnormal scales
    rel = ((back - x.float())[big].norm() / x.float()[big].norm()).item()
    assert 0.02 < rel < 0.15
    # the same tensor with an explicit (float or tensor) global scale gives the same bytes
    for given in (float(gs), gs.clone(), gs.reshape(())):
        p2, s2, g2 = quantize_nvfp4(x, given)
        assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
        assert torch.equal(g2, gs)


def test_all_equal_blocks_zeros_inside_a_block_and_zero_blocks():
    g = torch.Generator().manual_seed(13)
    c = float(torch.rand(1, generator=g)) * 10 + 0.5
    x = torch.randn(3, 48, generator=g)
    x[0, :16] = c  # all equal: every element is the block's maximum
    x[1, 16:32] = -c
    x[2, 3:9] = 0.0  # zeros among other values
    x[2, 32:48] = 0.0  # a whole block of zeros
    packed, scales, gs = quantize_nvfp4(x)
    codes = _codes(packed)
    assert len(set(codes[0][:16])) == 1 and codes[0][0] == 7  # 6 at the block's scale
    assert len(set(codes[1][16:32])) == 1 and codes[1][16] == 15
    assert codes[2][3:9] == [0] * 6 and codes[2][32:48] == [0] * 16 and float(scales[2, 2]) == 0.0
    back = dequantize_nvfp4(packed, scales, gs)
    assert bool((back[2, 32:48] == 0).all()) and bool((back[2, 3:9] == 0).all())
    assert bool(((back - x).abs() <= nvfp4_tolerance(x, gs)).all())
    assert float(back[0, 0]) == pytest.approx(c, rel=2.0 ** -4)  # only the e4m3 rounding of the scale


def test_large_and_small_magnitudes():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(4, 64, generator=g)
    x[0] *= 1e30  # fp32 only: the global scale follows the tensor's amax
    x[1] *= 1e-30  # far below the tensor's amax: flushed to zero
    packed, scales, gs = quantize_nvfp4(x)
    back = dequantize_nvfp4(packed, scales, gs)
    assert torch.isfinite(back).all() and bool((back[1] == 0).all())
    assert bool(((back - x).abs() <= nvfp4_tolerance(x, gs)).all())
    # a tensor of tiny values alone: the amax floor (1e-4) keeps the global scale finite; all flush to 0
    tiny = torch.randn(2, 32, generator=g) * 1e-30
    p, s, g2 = quantize_nvfp4(tiny)
    assert float(g2) == pytest.approx(2688.0 / 1e-4) and bool((dequantize_nvfp4(p, s, g2) == 0).all())
    # bf16 activations of large magnitude, each block well resolved
    big = (torch.randn(2, 64, generator=g) * 3e4).to(torch.bfloat16)
    p, s, g3 = quantize_nvfp4(big)
    assert bool(((dequantize_nvfp4(p, s, g3) - big.float()).abs() <= nvfp4_tolerance(big, g3)).all())


def test_nan_and_inf_policy():
    g = torch.Generator().manual_seed(15)
    x = torch.randn(2, 64, generator=g) + 0.1
    x[0, 5] = float("nan")  # block 0 of row 0
    x[1, 40] = float("inf")  # block 2 of row 1
    x[1, 50] = -float("inf")  # block 3 of row 1
    gs = nvfp4_global_scale(x)
    finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    assert float(gs) == pytest.approx(2688.0 / float(finite.abs().max()), rel=1e-6)  # non-finite ignored
    packed, scales, _ = quantize_nvfp4(x, gs)
    assert scales.view(torch.uint8)[0, 0] == 0x7F  # NaN scale: the whole block
    back = dequantize_nvfp4(packed, scales, gs)
    assert bool(back[0, :16].isnan().all()) and bool(torch.isfinite(back[0, 16:]).all())
    assert float(scales[1, 2]) == 448.0 and float(scales[1, 3]) == 448.0  # saturated
    top = 6.0 * 448.0 / float(gs)
    assert float(back[1, 40]) == pytest.approx(top) and float(back[1, 50]) == pytest.approx(-top)
    assert torch.isfinite(back[1]).all()
    others = [i for i in range(64) if i // 16 not in (2, 3)]
    assert bool(((back[1, others] - x[1, others]).abs() <= nvfp4_tolerance(x[1:], gs)[0, others]).all())


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="H % 16"):
        quantize_nvfp4(torch.randn(2, 24))
    with pytest.raises(ValueError, match="one value"):
        quantize_nvfp4(torch.randn(2, 32), torch.ones(2))


def _swizzled_offset(m: int, k: int, cols: int) -> int:
    """The 128x4 layout's byte offset of scale (m, k) as cuBLAS documents it, written out."""
    k_tiles = -(-cols // 4)
    return ((m // 128) * k_tiles + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


@pytest.mark.parametrize("rows,cols", [(1, 1), (5, 4), (130, 7), (256, 448 // 16)])
def test_swizzle_matches_the_documented_offsets(rows, cols):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    lin = torch.randint(1, 120, (rows, cols), dtype=torch.uint8, generator=g).view(SCALE_DTYPE)
    sw = swizzle_nvfp4_scales(lin)
    mp, kp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert sw.shape == (mp, kp) and sw.dtype == SCALE_DTYPE
    flat = sw.view(torch.uint8).reshape(-1).tolist()
    raw = lin.view(torch.uint8).tolist()
    placed = set()
    for m in range(rows):
        for k in range(cols):
            off = _swizzled_offset(m, k, cols)
            assert flat[off] == raw[m][k], (m, k)
            placed.add(off)
    assert all(flat[i] == 0 for i in range(len(flat)) if i not in placed)  # padding is zero
    assert torch.equal(unswizzle_nvfp4_scales(sw, rows, cols).view(torch.uint8), lin.view(torch.uint8))


def test_batched_swizzle_lays_out_each_matrix_on_its_own():
    g = torch.Generator().manual_seed(21)
    lin = torch.randint(1, 120, (3, 40, 12), dtype=torch.uint8, generator=g).view(SCALE_DTYPE)
    sw = swizzle_nvfp4_scales(lin)
    assert sw.shape == (3, 128, 12)
    for b in range(3):
        assert torch.equal(sw[b].view(torch.uint8), swizzle_nvfp4_scales(lin[b]).view(torch.uint8))
    assert torch.equal(unswizzle_nvfp4_scales(sw, 40, 12).view(torch.uint8), lin.view(torch.uint8))
    with pytest.raises(ValueError, match="do not hold"):
        unswizzle_nvfp4_scales(sw, 200, 12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_bit_identical_to_cpu(dtype):
    # the oracle quantises on the CPU; every step of the recipe is IEEE float32, so CUDA gives the same bytes
    g = torch.Generator().manual_seed(16)
    x = (torch.randn(257, 1024, generator=g) * torch.logspace(-4, 3, 257).unsqueeze(1)).to(dtype)
    p_cpu, s_cpu, g_cpu = quantize_nvfp4(x)
    p_gpu, s_gpu, g_gpu = quantize_nvfp4(x.cuda())
    assert torch.equal(g_gpu.cpu(), g_cpu)
    assert torch.equal(s_gpu.cpu().view(torch.uint8), s_cpu.view(torch.uint8))
    assert torch.equal(p_gpu.cpu(), p_cpu)
    assert torch.equal(swizzle_nvfp4_scales(s_gpu).cpu().view(torch.uint8),
                       swizzle_nvfp4_scales(s_cpu).view(torch.uint8))


def test_blocks_flush_to_zero_at_a_scale_of_two_to_the_minus_ten():
    x = torch.full((1, 16), 6.0)  # amax * fl32(1/6) rounds to exactly 1, so s = gs
    _, at, _ = quantize_nvfp4(x, 2.0 ** -10)  # a tie between 0 and e4m3's smallest subnormal: even, 0
    _, above, _ = quantize_nvfp4(x, 2.0 ** -10 * (1 + 2.0 ** -20))
    assert float(at[0, 0]) == 0.0 and float(above[0, 0]) == 2.0 ** -9
