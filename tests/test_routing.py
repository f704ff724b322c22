import pytest
import torch

from ep_comm import EPInputError, routing


def test_topk_matches_torch_without_nan():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 32, generator=g)
    v, i = routing.topk(logits, 6)
    rv, ri = torch.topk(logits, 6)
    assert torch.equal(i, ri) and torch.equal(v, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_nan_rows_yield_distinct_ids(dtype):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 64, generator=g).to(dtype)
    logits[3] = float("nan")  # whole row
    logits[7, ::2] = float("nan")  # half a row
    logits[9, 5] = float("nan")
    clean = logits.clone()
    v, ids = routing.topk(logits, 8)
    for row in range(16):
        assert len(set(ids[row].tolist())) == 8, f"row {row} has duplicate ids {ids[row].tolist()}"
        assert not torch.isnan(logits[row, ids[row]]).any() or row == 3
    # untouched rows equal torch.topk
    for row in (0, 1, 15):
        assert torch.equal(ids[row], torch.topk(clean[row], 8).indices)
    # row 7: the 32 finite entries rank first
    assert not torch.isnan(logits[7, ids[7]]).any()


def test_topk_k_too_large():
    with pytest.raises(EPInputError):
        routing.topk(torch.randn(2, 4), 5)


def test_sanitize_merges_duplicates_and_drops_minus_one():
    ids = torch.tensor([[3, 3, 5, -1], [1, 2, 1, 1], [-1, -1, -1, -1], [0, 7, 6, 5]], dtype=torch.int32)
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4], [1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.25, 0.125, 0.0625]])
    out_ids, out_w, bad = routing.sanitize_routing(ids, w, num_experts=8)
    assert out_ids.tolist() == [[3, -1, 5, -1], [1, 2, -1, -1], [-1, -1, -1, -1], [0, 7, 6, 5]]
    torch.testing.assert_close(out_w, torch.tensor(
        [[0.1 + 0.2, 0.0, 0.3, 0.0], [8.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.125, 0.0625]]))
    assert int(bad) == 0


def test_sanitize_counts_invalid_without_raising():
    ids = torch.tensor([[9, -2, 1], [0, 1, 100]])
    w = torch.ones(2, 3)
    out_ids, out_w, bad = routing.sanitize_routing(ids, w, num_experts=8)
    assert int(bad) == 3
    assert out_ids.tolist() == [[-1, -1, 1], [0, 1, -1]]
    assert out_w.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]


def test_sanitize_random_against_loop_reference():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(-1, 6, (200, 5), generator=g)
    w = torch.rand(200, 5, generator=g)
    out_ids, out_w, _ = routing.sanitize_routing(ids, w, num_experts=6)
    for t in range(200):
        want: dict = {}
        for j in range(5):
            e = int(ids[t, j])
            if e >= 0:
                want[e] = want.get(e, 0.0) + float(w[t, j])
        got = {int(e): float(x) for e, x in zip(out_ids[t], out_w[t]) if int(e) >= 0}
        assert got.keys() == want.keys()
        for e in want:
            assert abs(got[e] - want[e]) < 1e-6
        assert len([e for e in out_ids[t].tolist() if e >= 0]) == len(want)
        assert float(out_w[t][out_ids[t] < 0].abs().sum()) == 0.0


def test_check_ids_names_token_and_id():
    ids = torch.tensor([[0, 1], [2, 3], [4, 16]])
    with pytest.raises(EPInputError, match=r"topk_ids\[2, 1\] = 16"):
        routing.check_ids(ids, 16)
    with pytest.raises(EPInputError, match=r"topk_ids\[0, 0\] = -5"):
        routing.check_ids(torch.tensor([[-5, 1]]), 16)
    routing.check_ids(torch.tensor([[-1, 15]]), 16)


@pytest.mark.gpu
def test_topk_nan_rows_distinct_on_gpu():
    logits = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    logits[::3] = float("nan")  # whole rows of NaN: every candidate ties at -inf
    _, ids = routing.topk(logits, 8)
    for row in ids.cpu():
        assert len(set(row.tolist())) == 8
    clean = ~torch.isnan(logits).any(dim=1)
    assert torch.equal(ids[clean], torch.topk(logits[clean], 8).indices)
