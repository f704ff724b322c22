"""The oracle with quant="nvfp4": inputs carry one global scale, received rows are compared by
dequantising them against their source rows, within e2m1's precision, and corruption is caught."""
import pytest
import torch

from ep_comm import EPConfig, EPInputError, oracle
from ep_comm.layouts import Dispatched
from ep_comm.quant_nvfp4 import (
    SCALE_DTYPE,
    dequantize_nvfp4,
    e2m1_codes,
    nvfp4_global_scale,
    quantize_nvfp4,
    swizzle_nvfp4_scales,
)

WORLD = 2


def _cfg(**kw) -> EPConfig:
    base = dict(num_experts=6, top_k=3, hidden=64, max_tokens_per_rank=8, dtype=torch.bfloat16, quant="nvfp4")
    base.update(kw)
    return EPConfig(**base)


def _standard(cfg, inputs, rank, quantise=quantize_nvfp4) -> Dispatched:
    """A correct standard-layout Dispatched built by a plain loop over every source token."""
    L = cfg.num_experts // len(inputs)
    gs = inputs[0].x_scales
    xs, ss, ids, ws = [], [], [], []
    for inp in inputs:
        packed, scales, _ = quantise(inp.x, inp.x_scales)
        for t in range(inp.x.shape[0]):
            route = oracle.merged_routes(inp.topk_ids[t:t + 1], inp.topk_weights[t:t + 1], cfg.num_experts)[0]
            local = [(e - rank * L, w) for e, w in route.items() if e // L == rank]
            if not local:
                continue
            xs.append(packed[t]), ss.append(scales[t])
            ids.append([e for e, _ in local] + [-1] * (cfg.top_k - len(local)))
            ws.append([w for _, w in local] + [0.0] * (cfg.top_k - len(local)))
    return Dispatched("standard", torch.stack(xs), torch.stack(ss), torch.tensor(ids, dtype=torch.int32),
                      torch.tensor(ws), x_global_scale=gs)


def _batched(cfg, inputs, rank) -> Dispatched:
    L, cap = cfg.num_experts // len(inputs), cfg.capacity(len(inputs))
    x = torch.zeros(L, cap, cfg.hidden // 2, dtype=torch.uint8)
    s = torch.zeros(L, cap, cfg.hidden // 16, dtype=torch.uint8).view(SCALE_DTYPE)
    counts = [0] * L
    for inp in inputs:
        packed, scales, _ = quantize_nvfp4(inp.x, inp.x_scales)
        for t, route in enumerate(oracle.merged_routes(inp.topk_ids, inp.topk_weights, cfg.num_experts)):
            for e in route:
                if e // L == rank:
                    x[e % L, counts[e % L]], s[e % L, counts[e % L]] = packed[t], scales[t]
                    counts[e % L] += 1
    return Dispatched("batched", x, s, expert_num_tokens=torch.tensor(counts, dtype=torch.int32),
                      x_global_scale=inputs[0].x_scales)


def test_random_inputs_carry_one_global_scale_and_the_same_data():
    cfg = _cfg()
    inputs = oracle.random_inputs(cfg, 3, seed=5, tokens=[8, 0, 5])
    plain = oracle.random_inputs(cfg.replace(quant=None), 3, seed=5, tokens=[8, 0, 5])
    want = nvfp4_global_scale(torch.cat([i.x.float().reshape(-1) for i in inputs]))
    for inp, p in zip(inputs, plain):
        assert torch.equal(inp.x, p.x) and torch.equal(inp.topk_ids, p.topk_ids)  # no random number used
        assert inp.x_scales is not None and torch.equal(inp.x_scales, want) and inp.x_scales.dtype == torch.float32
    zero = oracle.random_inputs(cfg, 2, seed=5, tokens=[0, 0])  # nothing to measure: the amax floor
    assert float(zero[0].x_scales) == pytest.approx(2688.0 / 1e-4)
    with pytest.raises(ValueError, match="payload"):
        oracle.random_inputs(cfg, 2, seed=5, payload="uint8")
    with pytest.raises(ValueError, match="scales_width"):
        oracle.random_inputs(cfg, 2, seed=5, scales_width=3)


@pytest.mark.parametrize("layout", ["standard", "batched"])
def test_correct_rows_match_in_any_order(layout):
    cfg = _cfg(layout=layout)
    inputs = oracle.random_inputs(cfg, WORLD, seed=7, p_minus_one=0.2, p_duplicate=0.3)
    expected = oracle.expected_dispatch(cfg, inputs)
    for rank in range(WORLD):
        d = (_standard if layout == "standard" else _batched)(cfg, inputs, rank)
        assert oracle.compare_dispatch(cfg, d, expected[rank]) == []
        if layout == "standard":
            flipped = Dispatched("standard", d.x.flip(0), d.x_scales.flip(0), d.topk_ids.flip(0),
                                 d.topk_weights.flip(0), x_global_scale=d.x_global_scale)
            assert oracle.compare_dispatch(cfg, flipped, expected[rank]) == []


def _other_rounding(x, gs):
    """A quantiser that takes the other e4m3 neighbour of ``amax * gs / 6`` for every block scale: what
    a kernel whose float arithmetic rounds differently might do; the oracle must accept it."""
    packed, scales, g = quantize_nvfp4(x, gs)
    sf = scales.float()
    s_true = x.float().reshape(x.shape[0], -1, 16).abs().amax(-1) / 6 * g
    bits = scales.view(torch.uint8).to(torch.int32)
    other = torch.where(sf > s_true, bits - 1, bits + 1).clamp(0, 0x7E).to(torch.uint8).view(SCALE_DTYPE)
    q = x.float().reshape(x.shape[0], -1, 16) * (g / other.float()).unsqueeze(-1)
    codes = e2m1_codes(q).reshape(x.shape)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), other, g


def test_another_quantisers_rounding_is_within_tolerance():
    cfg = _cfg()
    inputs = oracle.random_inputs(cfg, WORLD, seed=8)
    expected = oracle.expected_dispatch(cfg, inputs)
    d = _standard(cfg, inputs, 0, quantise=_other_rounding)
    reference = _standard(cfg, inputs, 0)
    assert not torch.equal(d.x_scales.view(torch.uint8), reference.x_scales.view(torch.uint8))
    assert oracle.compare_dispatch(cfg, d, expected[0]) == []


def test_corruption_is_caught():
    cfg = _cfg()
    inputs = oracle.random_inputs(cfg, WORLD, seed=9)
    expected = oracle.expected_dispatch(cfg, inputs)[0]

    def nibbles_swapped(d):
        d.x[0] = (d.x[0] >> 4) | (d.x[0] << 4)

    def scale_doubled(d):  # one block's scale 2x: e4m3 exponent + 1
        d.x_scales.view(torch.uint8)[0, 1] += 8

    def sign_flipped(d):
        d.x[1, 3] ^= 0x88

    corruptions = {
        "nibbles swapped": nibbles_swapped,
        "scale doubled": scale_doubled,
        "sign flipped": sign_flipped,
        "row of another token": lambda d: d.x[0].copy_(d.x[1]),
        "global scale wrong": lambda d: setattr(d, "x_global_scale", d.x_global_scale * 2),
        "global scale missing": lambda d: setattr(d, "x_global_scale", None),
        "swizzled scales": lambda d: setattr(d, "x_scales", swizzle_nvfp4_scales(d.x_scales)),
        "fp32 scales": lambda d: setattr(d, "x_scales", d.x_scales.float()),
        "unquantised rows": lambda d: setattr(d, "x", torch.zeros(d.x.shape[0], cfg.hidden, dtype=torch.bfloat16)),
        "weight": lambda d: d.topk_weights.__setitem__((0, 0), 0.9),
    }
    for name, corrupt in corruptions.items():
        d = _standard(cfg, inputs, 0)
        corrupt(d)
        assert oracle.compare_dispatch(cfg, d, expected) != [], name


def test_combine_reference_and_experts_dequantise():
    cfg = _cfg(dtype=torch.float32)
    inputs = oracle.random_inputs(cfg, WORLD, seed=10)
    ys = oracle.expected_combine(cfg, inputs, lambda xf, e: xf)
    for inp, y in zip(inputs, ys):
        packed, scales, gs = quantize_nvfp4(inp.x, inp.x_scales)
        w = torch.tensor([sum(r.values()) for r in oracle.merged_routes(inp.topk_ids, inp.topk_weights, 6)])
        torch.testing.assert_close(y, dequantize_nvfp4(packed, scales, gs) * w.unsqueeze(1))
    d = _standard(cfg, inputs, 0)
    out = oracle.run_experts(cfg, 0, WORLD, d, expert_fn=lambda xf, e: xf, poison=False)
    want = dequantize_nvfp4(d.x, d.x_scales, d.x_global_scale) * d.topk_weights.sum(1, keepdim=True)
    torch.testing.assert_close(out, want)
    with pytest.raises(EPInputError, match="global scale"):
        oracle.payload_as_float(cfg, d.x, d.x_scales)
