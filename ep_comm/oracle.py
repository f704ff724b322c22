"""The oracle: plain-torch, single-process reference of dispatch/combine over all ranks' inputs.

This is the single source of truth every backend is compared with (tests, ``ep-comm stress``).  It is
written as loops over tokens, independent of the backends' vectorised code, so a bug in one does not
hide in the other.  Row order is backend-defined, so dispatch results are compared as multisets of
rows keyed by their payload bytes.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Optional, Sequence

import torch

from .config import EPConfig
from .errors import EPInputError
from .layouts import Dispatched
from .quant import dequantize_fp8, quantize_fp8
from .quant_nvfp4 import SCALE_DTYPE, dequantize_nvfp4, nvfp4_global_scale, nvfp4_tolerance, quantize_nvfp4

ExpertFn = Callable[[torch.Tensor, int], torch.Tensor]  # (float32 [n, hidden], global expert) -> [n, hidden]


@dataclasses.dataclass
class RankInput:
    """One rank's dispatch arguments (kept on the CPU here)."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    x_scales: Optional[torch.Tensor] = None

    def to(self, device) -> RankInput:
        s = None if self.x_scales is None else self.x_scales.to(device)
        return RankInput(self.x.to(device), self.topk_ids.to(device), self.topk_weights.to(device), s)


# -- inputs ------------------------------------------------------------------------------------------
def random_inputs(
    cfg: EPConfig,
    world: int,
    seed: int,
    tokens: Optional[Sequence[int]] = None,
    routing: str = "uniform",
    payload: str = "dtype",
    scales_width: int = 0,
    p_minus_one: float = 0.0,
    p_duplicate: float = 0.0,
) -> list[RankInput]:
    """Fresh random inputs for every rank, identical in every process that passes the same seed.

    ``payload``: "dtype" (x of cfg.dtype) or "uint8" (opaque ``[T, hidden // 2]`` bytes, e.g. NVFP4
    quantised by the caller).  With ``cfg.quant == "nvfp4"`` every rank's ``x_scales`` is the global
    scale, float32 ``[1]``: ``2688 / amax`` over all ranks' x (one tensor's recipe, the same on every rank).
    ``routing``: "uniform" (k distinct random experts per token) or "skewed" (every token's first
    choice is the same expert).  ``p_minus_one``/``p_duplicate``: chance per slot of -1 / of repeating
    the token's first id.
    """
    g = torch.Generator().manual_seed(seed)
    tokens = list(tokens) if tokens is not None else [cfg.max_tokens_per_rank] * world
    hot = int(torch.randint(cfg.num_experts, (1,), generator=g))
    out = []
    for t in tokens:
        if payload == "uint8":
            x = torch.randint(0, 256, (t, cfg.hidden // 2), dtype=torch.uint8, generator=g)
        else:
            x = torch.randn(t, cfg.hidden, generator=g).to(cfg.dtype)
        ids = torch.argsort(torch.rand(t, cfg.num_experts, generator=g), dim=1)[:, : cfg.top_k]
        if routing not in ("uniform", "skewed"):
            raise ValueError(f"routing must be 'uniform' or 'skewed', got {routing!r}")
        if routing == "skewed" and t:
            swap = ids == hot
            ids[swap] = ids[:, :1].expand_as(ids)[swap]  # keep rows distinct after forcing slot 0
            ids[:, 0] = hot
        if p_duplicate and cfg.top_k > 1:
            dup = torch.rand(t, cfg.top_k, generator=g) < p_duplicate
            dup[:, 0] = False
            ids = torch.where(dup, ids[:, :1].expand_as(ids), ids)
        if p_minus_one:
            ids = torch.where(torch.rand(t, cfg.top_k, generator=g) < p_minus_one, torch.full_like(ids, -1), ids)
        w = torch.rand(t, cfg.top_k, generator=g).float() + 0.05
        s = torch.randn(t, scales_width, generator=g) if scales_width else None
        out.append(RankInput(x, ids.to(torch.int32), w, s))
    if cfg.quant == "nvfp4":
        if payload != "dtype" or scales_width:
            raise ValueError("quant='nvfp4' quantises x of cfg.dtype and takes the global scale as x_scales: "
                             "payload must be 'dtype' and scales_width 0")
        out = with_global_scale(out)
    return out


def with_global_scale(inputs: Sequence[RankInput]) -> list[RankInput]:
    """``inputs`` with every rank's ``x_scales`` set to the NVFP4 global scale of all ranks' x together
    (float32 ``[1]``, computed on the CPU: ``quant_nvfp4.nvfp4_global_scale``)."""
    flat = [inp.x.detach().cpu().reshape(-1).float() for inp in inputs]
    gs = nvfp4_global_scale(torch.cat(flat) if flat else torch.zeros(0))
    return [dataclasses.replace(inp, x_scales=gs.clone()) for inp in inputs]


# -- the reference ------------------------------------------------------------------------------------
def merged_routes(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> list[dict[int, float]]:
    """Per token: ``{global expert: summed weight}`` (duplicates merged, -1 skipped)."""
    routes = []
    # Python lists, not tensor indexing (a tensor per element): the same ints and float values
    for t, (id_row, w_row) in enumerate(zip(ids.tolist(), weights.tolist())):
        row: dict[int, float] = {}
        for j, (e, w) in enumerate(zip(id_row, w_row)):
            if e == -1:
                continue
            if not 0 <= e < num_experts:
                raise EPInputError(f"topk_ids[{t}, {j}] = {e} out of range")
            row[e] = row.get(e, 0.0) + w
        routes.append(row)
    return routes


def wire_payload(cfg: EPConfig, inp: RankInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What travels: the fp8 or NVFP4 quantised payload and its block scales (NVFP4: with the global
    scale ``inp.x_scales``), or x and x_scales unchanged."""
    if cfg.quant == "fp8":
        return quantize_fp8(inp.x.cpu())
    if cfg.quant == "nvfp4":
        packed, scales, _ = quantize_nvfp4(inp.x.cpu(), _global_scale_of(inp))
        return packed, scales
    return inp.x.cpu(), None if inp.x_scales is None else inp.x_scales.cpu()


def _global_scale_of(inp: RankInput) -> torch.Tensor:
    if inp.x_scales is None:
        raise EPInputError("quant='nvfp4': the input's x_scales must hold the global scale, got None")
    return inp.x_scales.cpu()


def payload_as_float(cfg: EPConfig, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                     global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 ``[..., hidden]`` view of a received payload, what a test expert computes on
    (``global_scale``: quant="nvfp4" only, the ``Dispatched.x_global_scale``)."""
    if cfg.quant == "fp8":
        if x_scales is None:
            raise EPInputError("quant='fp8': the payload's x_scales are needed to dequantise it, got None")
        xf = dequantize_fp8(x, x_scales)
    elif cfg.quant == "nvfp4":
        if x_scales is None or global_scale is None:
            raise EPInputError("quant='nvfp4': the block scales (x_scales) and the global scale are needed to "
                               "dequantise the payload")
        xf = dequantize_nvfp4(x, x_scales, global_scale)
    elif x.dtype == torch.uint8:
        xf = x.float() / 255.0
    else:
        xf = x.float()
    if xf.shape[-1] != cfg.hidden:  # opaque narrower payload: tile it to the hidden width
        reps = -(-cfg.hidden // xf.shape[-1])
        xf = xf.tile((1,) * (xf.dim() - 1) + (reps,))[..., : cfg.hidden]
    return xf


def test_expert(xf: torch.Tensor, expert: int) -> torch.Tensor:
    """A deterministic, expert-dependent, non-linear stand-in for an expert MLP."""
    return torch.tanh(xf) * (1.0 + 0.25 * (expert % 5)) + 0.01 * expert


@dataclasses.dataclass
class ExpectedRank:
    """What one rank must receive."""

    rows: dict  # key -> list of {local expert: weight} (standard; one entry per source token)
    per_expert: list  # per local expert: Counter of keys (batched)
    # quant="nvfp4": key -> the source row unquantised (float32 [hidden]), and the inputs' global scale;
    # received rows are matched to them by dequantising (``_nvfp4_keys``)
    originals: dict = dataclasses.field(default_factory=dict)
    global_scale: Optional[float] = None


def _row_key(x_row: torch.Tensor, s_row: Optional[torch.Tensor]) -> bytes:
    key = x_row.contiguous().view(torch.uint8).numpy().tobytes()
    if s_row is not None:
        key += s_row.contiguous().view(torch.uint8).numpy().tobytes()
    return key


def _active(world: int, active_ranks: Optional[Sequence[int]]) -> set[int]:
    active = set(range(world)) if active_ranks is None else {int(r) for r in active_ranks}
    if not active <= set(range(world)):
        raise EPInputError(f"active_ranks {sorted(active)} outside [0, {world})")
    return active


def expected_dispatch(cfg: EPConfig, inputs: Sequence[RankInput],
                      active_ranks: Optional[Sequence[int]] = None) -> list[ExpectedRank]:
    """What each rank must receive; ``inputs`` holds one entry per rank of the original world.

    ``active_ranks`` (after ``Communicator.shrink``): the ranks still in.  The inputs of the others are
    ignored (they send nothing) and their experts are removed from every route (nobody receives those
    pairs); their entries in the result stay empty."""
    world = len(inputs)
    L = cfg.num_experts // world
    active = _active(world, active_ranks)
    out = [ExpectedRank(collections.defaultdict(list), [collections.Counter() for _ in range(L)]) for _ in range(world)]
    nvfp4 = cfg.quant == "nvfp4"
    for src, inp in enumerate(inputs):
        if src not in active:
            continue
        # NVFP4 rows are known by their source bytes (cfg.dtype): a backend's quantiser may differ from
        # the reference at rounding ties, so received rows are matched by value, not by their bytes
        x, s = (inp.x.cpu(), None) if nvfp4 else wire_payload(cfg, inp)
        if nvfp4:
            gs = float(_global_scale_of(inp).reshape(-1)[0])
            for r in range(world):
                out[r].global_scale = gs
        for t, route in enumerate(merged_routes(inp.topk_ids.cpu(), inp.topk_weights.cpu(), cfg.num_experts)):
            key = _row_key(x[t], None if s is None else s[t])
            by_rank: dict[int, dict[int, float]] = collections.defaultdict(dict)
            for e, w in route.items():
                if e // L in active:
                    by_rank[e // L][e % L] = w
            for r, local in by_rank.items():
                out[r].rows[key].append(local)
                if nvfp4:
                    out[r].originals[key] = x[t].float()
                for e in local:
                    out[r].per_expert[e][key] += 1
    return out


def expected_combine(cfg: EPConfig, inputs: Sequence[RankInput], expert_fn: ExpertFn = test_expert,
                     active_ranks: Optional[Sequence[int]] = None) -> list[torch.Tensor]:
    """Per rank ``[T, hidden]`` float32: ``y[t] = Σ_e w_e · expert_fn(x[t], e)``; 0 without experts.

    ``active_ranks``: as in ``expected_dispatch``: the sum runs over the experts of active ranks only,
    and inactive ranks' entries are computed all the same (nobody compares them)."""
    return [expected_combine_rank(cfg, inputs, r, expert_fn, active_ranks) for r in range(len(inputs))]


def expected_combine_rank(cfg: EPConfig, inputs: Sequence[RankInput], rank: int, expert_fn: ExpertFn = test_expert,
                          active_ranks: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``expected_combine(...)[rank]`` alone: a rank's combine depends only on its own tokens, so a test
    rank that checks its own result need not compute the others'."""
    L = cfg.num_experts // len(inputs)
    active = _active(len(inputs), active_ranks)
    inp = inputs[rank]
    x, s = wire_payload(cfg, inp)
    y = torch.zeros(x.shape[0], cfg.hidden)
    # the j-th entry of every token's route at once, j in route order, one expert_fn call per (j,
    # expert): each token's terms are added in its route's order, as one token at a time would
    terms: dict[tuple[int, int], tuple[list[int], list[float]]] = collections.defaultdict(lambda: ([], []))
    for t, route in enumerate(merged_routes(inp.topk_ids.cpu(), inp.topk_weights.cpu(), cfg.num_experts)):
        for j, (e, w) in enumerate(route.items()):
            if e // L in active:
                terms[(j, e)][0].append(t)
                terms[(j, e)][1].append(w)
    if terms:
        gs = _global_scale_of(inp) if cfg.quant == "nvfp4" else None
        xf = payload_as_float(cfg, x, s, gs)  # elementwise: the same values as row by row
        for (_, e), (tokens, weights) in sorted(terms.items()):
            idx = torch.tensor(tokens)
            y[idx] += torch.tensor(weights).unsqueeze(1) * expert_fn(xf[idx], e)
    return y


def expected_inactive_pairs(cfg: EPConfig, inputs: Sequence[RankInput], active_ranks: Sequence[int]) -> list[int]:
    """Per rank: how many (token, expert) pairs of its tokens (duplicates merged, -1 skipped) go to an
    expert whose owner is not in ``active_ranks`` (``Dispatched.inactive_pairs``)."""
    L = cfg.num_experts // len(inputs)
    active = _active(len(inputs), active_ranks)
    return [sum(1 for route in merged_routes(inp.topk_ids.cpu(), inp.topk_weights.cpu(), cfg.num_experts)
                for e in route if e // L not in active) for inp in inputs]


# -- what an engine does between dispatch and combine -----------------------------------------------------
def run_experts(cfg: EPConfig, rank: int, world: int, d: Dispatched, expert_fn: ExpertFn = test_expert,
                poison: bool = True) -> torch.Tensor:
    """Apply ``expert_fn`` to a ``Dispatched`` the way an engine's MoE kernel would.

    batched: ``[L, capacity, hidden]`` unweighted outputs; standard: ``[N, hidden]`` rows weighted and
    summed over the row's local experts.  Padding rows/slots are NaN when ``poison`` (combine must
    ignore them).  Runs on ``d``'s device, output dtype ``cfg.dtype``.
    """
    L = cfg.num_experts // world
    dev = d.x.device
    if d.layout == "batched":
        out = torch.full((L, d.x.shape[1], cfg.hidden), float("nan") if poison else 0.0, device=dev)
        counts = d.filled("expert_num_tokens").tolist()
        for e in range(L):
            n = counts[e]
            if n:
                s = None if d.x_scales is None else d.x_scales[e, :n]
                out[e, :n] = expert_fn(payload_as_float(cfg, d.x[e, :n], s, d.x_global_scale), rank * L + e)
        return out.to(cfg.dtype)
    xf = payload_as_float(cfg, d.x, d.x_scales, d.x_global_scale)
    out = torch.zeros(d.x.shape[0], cfg.hidden, device=dev)
    ids, w = d.filled("topk_ids"), d.filled("topk_weights")
    for e in torch.unique(ids[ids >= 0]).tolist():
        wt = torch.where(ids == e, w, torch.zeros_like(w)).sum(dim=1, keepdim=True)
        out += wt * expert_fn(xf, rank * L + e)
    if poison:
        out[(ids < 0).all(dim=1)] = float("nan")
    return out.to(cfg.dtype)


# -- comparison ---------------------------------------------------------------------------------------------
def compare_dispatch(cfg: EPConfig, d: Dispatched, expected: ExpectedRank, max_report: int = 5) -> list[str]:
    """Differences between a backend's ``Dispatched`` and the oracle's (empty list = match).

    Rows are compared as multisets keyed by their bytes; with ``quant="nvfp4"`` by value instead: each
    received row, dequantised, must lie within ``quant_nvfp4.nvfp4_tolerance`` of its source row
    (``_nvfp4_keys``), so a kernel whose rounding differs from the reference at ties still matches.
    """
    problems: list[str] = _nvfp4_format_problems(cfg, d, expected) if cfg.quant == "nvfp4" else []
    if problems:
        return problems
    if d.layout == "batched":
        counts = d.filled("expert_num_tokens").cpu().tolist()
        x, s = d.x.cpu(), None if d.x_scales is None else d.x_scales.cpu()
        for e, want in enumerate(expected.per_expert):
            n = counts[e]
            if n != sum(want.values()):
                problems.append(f"expert {e}: expert_num_tokens={n}, expected {sum(want.values())}")
                continue
            keys = collections.Counter(_received_keys(cfg, d, expected, x[e, :n], None if s is None else s[e, :n]))
            if keys != want:
                problems.append(f"expert {e}: received rows differ from the oracle ({len(keys - want)} unexpected, "
                                f"{len(want - keys)} missing)")
            if len(problems) >= max_report:
                break
        return problems

    ids, w = d.filled("topk_ids").cpu(), d.filled("topk_weights").cpu()
    if ids.dtype != torch.int32:
        problems.append(f"topk_ids dtype {ids.dtype}, expected int32")
    if bool((w[ids < 0] != 0).any()):
        problems.append("topk_weights non-zero where topk_ids is -1")
    if bool(((ids < -1) | (ids >= len(expected.per_expert))).any()):
        problems.append(f"topk_ids outside [-1, {len(expected.per_expert)})")
    x, s = d.x.cpu(), None if d.x_scales is None else d.x_scales.cpu()
    live = torch.nonzero((ids >= 0).any(dim=1)).flatten()
    row_keys = _received_keys(cfg, d, expected, x[live], None if s is None else s[live])
    got: dict[bytes, list[dict[int, float]]] = collections.defaultdict(list)
    for i, key in zip(live.tolist(), row_keys):
        local: dict[int, float] = {}
        for j in torch.nonzero(ids[i] >= 0).flatten().tolist():
            e = int(ids[i, j])
            if e in local:
                problems.append(f"row {i}: local expert {e} appears twice (duplicates must be merged)")
            local[e] = local.get(e, 0.0) + float(w[i, j])
        got[key].append(local)
    if set(got) != set(expected.rows):
        n_got, n_want = sum(map(len, got.values())), sum(map(len, expected.rows.values()))
        extra, missing = len(set(got) - set(expected.rows)), len(set(expected.rows) - set(got))
        problems.append(f"received {n_got} rows, expected {n_want}; {extra} unexpected, {missing} missing")
        return problems[:max_report]
    for key, want in expected.rows.items():
        have = got[key]
        if not _same_routes(have, want):
            problems.append(f"row routes differ: got {have[:2]}, expected {want[:2]}")
            if len(problems) >= max_report:
                break
    return problems


def _received_keys(cfg: EPConfig, d: Dispatched, expected: ExpectedRank, x: torch.Tensor,
                   s: Optional[torch.Tensor]) -> list[bytes]:
    """The oracle's key of each received row ``x [n, W]`` (scales ``s [n, S]``)."""
    if cfg.quant == "nvfp4":
        return _nvfp4_keys(expected, x, s, d.x_global_scale)
    return [_row_key(x[i], None if s is None else s[i]) for i in range(x.shape[0])]


def _nvfp4_format_problems(cfg: EPConfig, d: Dispatched, expected: ExpectedRank) -> list[str]:
    """What an NVFP4 ``Dispatched`` must be before its rows can be read: uint8 ``[..., hidden // 2]``
    rows, float8_e4m3fn ``[..., hidden // 16]`` linear block scales, the inputs' global scale."""
    problems = []
    if d.x.dtype != torch.uint8 or d.x.shape[-1] != cfg.hidden // 2:
        problems.append(f"nvfp4: x is {d.x.dtype} {tuple(d.x.shape)}, expected uint8 [..., {cfg.hidden // 2}]")
    s = d.x_scales
    if s is None or s.dtype != SCALE_DTYPE or tuple(s.shape) != tuple(d.x.shape[:-1]) + (cfg.hidden // 16,):
        got = None if s is None else f"{s.dtype} {tuple(s.shape)}"
        problems.append(f"nvfp4: x_scales is {got}, expected {SCALE_DTYPE} {list(d.x.shape[:-1]) + [cfg.hidden // 16]}")
    gs = d.x_global_scale
    if gs is None or gs.numel() != 1:
        problems.append(f"nvfp4: x_global_scale is {None if gs is None else tuple(gs.shape)}, expected one value")
    elif expected.global_scale is not None and float(gs.reshape(-1)[0]) != expected.global_scale:
        problems.append(f"nvfp4: x_global_scale {float(gs.reshape(-1)[0])}, expected {expected.global_scale}")
    return problems


_MATCH_CHUNK = 256  # received rows per distance computation (bounds its [chunk, candidates] memory)


def _nvfp4_keys(expected: ExpectedRank, x: torch.Tensor, s: Optional[torch.Tensor],
                global_scale: Optional[torch.Tensor]) -> list[bytes]:
    """Each received NVFP4 row's source key: the nearest source row (L2), accepted only if every
    element of the dequantised row lies within ``nvfp4_tolerance`` of it; else a key of its own, which
    the comparison reports as unexpected."""
    n = x.shape[0]
    keys = list(expected.originals)
    unmatched = [b"\0unmatched %d" % i for i in range(n)]
    if not n or not keys or s is None or global_scale is None:
        return unmatched
    gs = global_scale.detach().cpu()
    got = dequantize_nvfp4(x, s, gs)
    originals = torch.stack([expected.originals[k] for k in keys])
    tolerance = nvfp4_tolerance(originals, gs)
    out = []
    for lo in range(0, n, _MATCH_CHUNK):
        chunk = got[lo: lo + _MATCH_CHUNK]
        nearest = torch.cdist(torch.nan_to_num(chunk, nan=1e30), originals).argmin(dim=1)
        ok = ((chunk - originals[nearest]).abs() <= tolerance[nearest]).all(dim=1)
        out += [keys[j] if good else unmatched[lo + i]
                for i, (j, good) in enumerate(zip(nearest.tolist(), ok.tolist()))]
    return out


def _same_routes(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    canon = lambda rs: sorted((tuple(sorted(r)), tuple(r[k] for k in sorted(r))) for r in rs)  # noqa: E731
    for (ka, wa), (kb, wb) in zip(canon(a), canon(b)):
        if ka != kb or any(abs(x - y) > 1e-5 * max(1.0, abs(y)) for x, y in zip(wa, wb)):
            return False
    return True


def combine_tolerance(cfg: EPConfig) -> float:
    """Max relative error of combine vs the oracle: output rounding to cfg.dtype dominates."""
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[cfg.dtype]


def compare_combine(cfg: EPConfig, y: torch.Tensor, expected: torch.Tensor) -> list[str]:
    y, expected = y.detach().float().cpu(), expected.detach().float().cpu()
    if tuple(y.shape) != tuple(expected.shape):
        return [f"combine output shape {tuple(y.shape)}, expected {tuple(expected.shape)}"]
    if not torch.isfinite(y).all():
        return ["combine output has NaN/Inf"]
    if expected.numel() == 0:
        return []
    err = (y - expected).norm() / expected.norm().clamp_min(1e-12)
    worst = (y - expected).abs().max()
    tol = combine_tolerance(cfg)
    if err > tol or worst > 50 * tol * max(1.0, float(expected.abs().max())):
        return [f"combine differs from oracle: rel err {float(err):.3g} (tol {tol:g}), max abs err {float(worst):.3g}"]
    return []
