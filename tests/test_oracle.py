"""The oracle against hand-computed results, and the comparators against deliberate corruption."""
import collections

import pytest
import torch

from ep_comm import EPConfig, EPInputError, oracle
from ep_comm.layouts import Dispatched


def tiny_cfg(**kw):
    base = dict(num_experts=4, top_k=2, hidden=4, max_tokens_per_rank=3, dtype=torch.float32, layout="standard")
    base.update(kw)
    return EPConfig(**base)


def tiny_inputs():
    # world 2: rank 0 owns experts {0, 1}, rank 1 owns {2, 3}
    r0 = oracle.RankInput(
        x=torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]]),
        topk_ids=torch.tensor([[0, 3], [1, 1]], dtype=torch.int32),  # token 1 has a duplicate
        topk_weights=torch.tensor([[0.5, 0.25], [0.1, 0.2]]),
    )
    r1 = oracle.RankInput(
        x=torch.tensor([[-1.0, -2, -3, -4]]),
        topk_ids=torch.tensor([[-1, 2]], dtype=torch.int32),
        topk_weights=torch.tensor([[9.0, 0.75]]),
    )
    return [r0, r1]


def key(row):
    return torch.tensor(row, dtype=torch.float32).view(torch.uint8).numpy().tobytes()


def test_expected_dispatch_by_hand():
    exp = oracle.expected_dispatch(tiny_cfg(), tiny_inputs())
    # rank 0 gets token (0,0) for local expert 0 and token (0,1) for local expert 1 (merged weight 0.3)
    assert dict(exp[0].rows) == {key([1, 2, 3, 4]): [{0: 0.5}], key([5, 6, 7, 8]): [{1: pytest.approx(0.3)}]}
    assert exp[0].per_expert == [collections.Counter({key([1, 2, 3, 4]): 1}),
                                 collections.Counter({key([5, 6, 7, 8]): 1})]
    # rank 1 gets token (0,0) for local expert 1 (global 3) and token (1,0) for local expert 0 (global 2)
    assert dict(exp[1].rows) == {key([1, 2, 3, 4]): [{1: 0.25}], key([-1, -2, -3, -4]): [{0: 0.75}]}


def test_expected_combine_by_hand():
    f = lambda xf, e: xf * (e + 1)  # noqa: E731 - a linear expert makes hand computation easy
    y0, y1 = oracle.expected_combine(tiny_cfg(), tiny_inputs(), f)
    x00, x01, x10 = torch.tensor([1.0, 2, 3, 4]), torch.tensor([5.0, 6, 7, 8]), torch.tensor([-1.0, -2, -3, -4])
    torch.testing.assert_close(y0[0], 0.5 * 1 * x00 + 0.25 * 4 * x00)
    torch.testing.assert_close(y0[1], (0.1 + 0.2) * 2 * x01)
    torch.testing.assert_close(y1[0], 0.75 * 3 * x10)


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4"])
def test_expected_combine_is_each_tokens_route_summed_in_order(quant):
    # the definition, one token at a time: y[t] = sum over t's merged route, in its order, of
    # w * expert(x[t], e), on what travels (the dequantised payload when quantised); bit for bit
    world, tokens = 4, 40
    cfg = EPConfig(num_experts=16, top_k=4, hidden=128, max_tokens_per_rank=tokens, quant=quant)
    inputs = oracle.random_inputs(cfg, world, seed=int(torch.randint(1 << 30, ())), tokens=[tokens, 7, 0, tokens],
                                 p_minus_one=0.1, p_duplicate=0.1)
    active = [0, 2, 3]
    got = oracle.expected_combine(cfg, inputs, active_ranks=active)
    for inp, y in zip(inputs, got):
        x, s = oracle.wire_payload(cfg, inp)
        gs = inp.x_scales if quant == "nvfp4" else None
        want = torch.zeros(x.shape[0], cfg.hidden)
        routes = oracle.merged_routes(inp.topk_ids, inp.topk_weights, cfg.num_experts)
        for t, route in enumerate(routes):
            xf = oracle.payload_as_float(cfg, x[t: t + 1], None if s is None else s[t: t + 1], gs)
            for e, w in route.items():
                if e // (cfg.num_experts // world) in active:
                    want[t] += w * oracle.test_expert(xf, e)[0]
        assert torch.equal(y, want)


def test_oracle_rejects_out_of_range():
    bad = tiny_inputs()
    bad[1].topk_ids[0, 1] = 4
    with pytest.raises(EPInputError):
        oracle.expected_dispatch(tiny_cfg(), bad)


def _standard_from_oracle(cfg, inputs, rank):
    """A correct standard-layout Dispatched built by hand from the inputs (for comparator tests)."""
    L = cfg.num_experts // len(inputs)
    xs, ids, ws = [], [], []
    for inp in inputs:
        for t in range(inp.x.shape[0]):
            route = oracle.merged_routes(inp.topk_ids[t:t + 1], inp.topk_weights[t:t + 1], cfg.num_experts)[0]
            local = [(e - rank * L, w) for e, w in route.items() if e // L == rank]
            row_ids = [e for e, _ in local] + [-1] * (cfg.top_k - len(local))
            row_w = [w for _, w in local] + [0.0] * (cfg.top_k - len(local))
            xs.append(inp.x[t]), ids.append(row_ids), ws.append(row_w)
    return Dispatched("standard", torch.stack(xs), None, torch.tensor(ids, dtype=torch.int32), torch.tensor(ws))


def test_compare_dispatch_accepts_correct_and_catches_corruption():
    cfg, inputs = tiny_cfg(), tiny_inputs()
    exp = oracle.expected_dispatch(cfg, inputs)
    good = _standard_from_oracle(cfg, inputs, 0)
    assert oracle.compare_dispatch(cfg, good, exp[0]) == []
    # reversed row order is fine (order is backend-defined)
    rev = Dispatched("standard", good.x.flip(0), None, good.topk_ids.flip(0), good.topk_weights.flip(0))
    assert oracle.compare_dispatch(cfg, rev, exp[0]) == []
    corruptions = {
        "weight": lambda d: d.topk_weights.__setitem__((0, 0), 0.9),
        "expert": lambda d: d.topk_ids.__setitem__((0, 0), 1),
        "payload": lambda d: d.x.__setitem__((0, 0), 42.0),
        "dropped row": lambda d: d.topk_ids.__setitem__((0, slice(None)), -1),
        "weight on -1": lambda d: d.topk_weights.__setitem__((1, 1), 0.5),
    }
    for name, corrupt in corruptions.items():
        d = _standard_from_oracle(cfg, inputs, 0)
        corrupt(d)
        assert oracle.compare_dispatch(cfg, d, exp[0]) != [], name


def test_compare_dispatch_batched_catches_count_and_rows():
    cfg = tiny_cfg(layout="batched")
    inputs = tiny_inputs()
    exp = oracle.expected_dispatch(cfg, inputs)[1]
    cap = 6
    x = torch.full((2, cap, 4), float("nan"))
    x[0, 0] = torch.tensor([-1.0, -2, -3, -4])
    x[1, 0] = torch.tensor([1.0, 2, 3, 4])
    good = Dispatched("batched", x, expert_num_tokens=torch.tensor([1, 1], dtype=torch.int32))
    assert oracle.compare_dispatch(cfg, good, exp) == []
    bad_count = Dispatched("batched", x, expert_num_tokens=torch.tensor([1, 2], dtype=torch.int32))
    assert oracle.compare_dispatch(cfg, bad_count, exp) != []
    swapped = Dispatched("batched", x[[1, 0]], expert_num_tokens=torch.tensor([1, 1], dtype=torch.int32))
    assert oracle.compare_dispatch(cfg, swapped, exp) != []


def test_compare_combine_tolerance_and_nan():
    cfg = tiny_cfg(dtype=torch.bfloat16)
    ref = torch.randn(5, 4)
    assert oracle.compare_combine(cfg, ref.to(torch.bfloat16), ref) == []
    assert oracle.compare_combine(cfg, (ref * 1.1).to(torch.bfloat16), ref) != []
    nan = ref.clone()
    nan[2, 1] = float("nan")
    assert oracle.compare_combine(cfg, nan, ref) != []
    assert oracle.compare_combine(cfg, ref[:4], ref) != []


def test_random_inputs_are_deterministic_and_fresh():
    cfg = EPConfig(num_experts=16, top_k=4, hidden=128, max_tokens_per_rank=8)
    a = oracle.random_inputs(cfg, 2, seed=1)
    b = oracle.random_inputs(cfg, 2, seed=1)
    c = oracle.random_inputs(cfg, 2, seed=2)
    assert torch.equal(a[1].x, b[1].x) and not torch.equal(a[1].x, c[1].x)
    assert a[0].x.abs().sum() > 0
    for row in a[0].topk_ids:
        assert len(set(row.tolist())) == cfg.top_k  # uniform routing: distinct experts
    skew = oracle.random_inputs(cfg, 2, seed=3, routing="skewed")
    hot = int(skew[0].topk_ids[0, 0])
    assert all(int(r[0]) == hot and len(set(r.tolist())) == cfg.top_k for inp in skew for r in inp.topk_ids)
