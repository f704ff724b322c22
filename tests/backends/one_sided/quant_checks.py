"""What the fused-quantisation kernel tests (test_fp8_kernel.py, test_nvfp4_kernel.py) share: the
received rows compared byte for byte with the reference quantiser's, and the spawned runs cached per
module so that every parametrised case reads one run."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import cases
from .test_mnnvl import _spawn

#: ``diff(got_x, got_s, want_x, want_s, src_x) -> str``: where a received row first differs, in words
RowDiff = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], str]


def row_bytes(x: torch.Tensor, s: torch.Tensor) -> bytes:
    """A row's payload bytes, then its scale bytes."""
    return x.contiguous().view(torch.uint8).numpy().tobytes() + s.contiguous().view(torch.uint8).numpy().tobytes()


def compare_rows(layout: str, x: torch.Tensor, s: torch.Tensor, counts: Optional[torch.Tensor],
                 ref: list[tuple[torch.Tensor, torch.Tensor]], xs: list[torch.Tensor], tokens: int,
                 diff: RowDiff) -> list[str]:
    """Problems of one dispatch that sent every token of every rank to this rank (``x``, ``s`` on the
    CPU; ``ref[src]`` = the reference's (payload, scales) of rank src's input ``xs[src]``).  Standard:
    row ``src * tokens + t`` is rank src's token t, byte for byte.  Batched: each expert holds every
    reference row once, in any order (``counts``: the experts' row counts)."""
    world = len(ref)
    problems: list[str] = []
    if layout == "standard":
        for src in range(world):
            for t in range(tokens):
                row = src * tokens + t
                want_x, want_s = ref[src][0][t], ref[src][1][t]
                if row_bytes(x[row], s[row]) != row_bytes(want_x, want_s):
                    where = diff(x[row], s[row], want_x, want_s, xs[src][t])
                    problems.append(f"row {row} (rank {src} token {t}): {where}")
        return problems
    assert counts is not None, "the batched layout has per-expert counts"
    want = sorted(row_bytes(ref[src][0][t], ref[src][1][t]) for src in range(world) for t in range(tokens))
    for e in range(x.shape[0]):
        n = int(counts[e])
        got = sorted(row_bytes(x[e, i], s[e, i]) for i in range(n))
        if got != want:
            stray = sum(1 for b in got if b not in set(want))
            problems.append(f"expert {e}: {n} rows, {stray} not among the reference rows (expected {len(want)})")
    return problems


_cache: dict = {}


def cached_run(name: str, fn, *args, env: Optional[dict] = None) -> dict:
    """``fn(*args)`` on every rank, merged (``cases.merge_ranks``), once per test module and ``name``:
    mnnvl's spawn without ``env``, nvshmem's (one PE per GPU, ``env`` added) with it."""
    key = (fn.__module__, name)
    if key not in _cache:
        if env is None:
            _cache[key] = cases.merge_ranks(_spawn(fn, *args))
        else:
            from .test_nvshmem import _spawn as spawn_nvshmem
            _cache[key] = cases.merge_ranks(spawn_nvshmem(fn, *args, env=env))
    return _cache[key]


def assert_clean(results: dict, case: str) -> None:
    assert case in results
    assert results[case] == [], "\n".join(results[case])
