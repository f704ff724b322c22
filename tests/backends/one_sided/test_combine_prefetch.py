"""The combine's prefetching sums on the GPU (mnnvl): the kernels that ask the L2 for a row's next column
block while summing this one run only where a warp's loop is long, pieces wider than one iteration and
at least two of them per warp (csrc/one_sided/combine.cu, ``combine_prefetches``).  The other tests'
256-channel rows never take them; here rows of 2048 channels on 4 SMs with up to 256 tokens per rank
do, for the ranks with many tokens, next to ranks with few that do not: pushed and pulled (zero copy)
combines with every payload, with and without receive hooks; grouped ones (interleaved and split) with
bf16 and fp8, no rank or the even ranks hooked.  Skipped without CUDA.
"""
from __future__ import annotations

import pytest

from .. import cases, zero_copy_cases
from . import spawned
from .grouped_cases import forced_grouped_worker

pytestmark = [pytest.mark.gpu]

HIDDEN = 2048  # bf16 rows of 4 KB: 2 iterations of a warp's sum loop per row piece
SMS = 4  # 64 warps: a rank with 256 tokens sums four pieces per warp (the kernels need two)
MAX_TOKENS = 256  # 8 groups of 32 per peer for the grouped form
GROUPED_MODES = {"1": "interleaved", "split:3": "split"}  # $EP_COMM_COMBINE_GROUPED -> case name

_results = spawned.CaseResults()
_run = _results.results
_assert_clean = _results.assert_clean


def pushed_matrix(hooks: bool) -> dict:
    return cases.backend_matrix(("mnnvl",), ("standard", "batched"), 1, hooks, hidden=HIDDEN, num_sms=SMS,
                                max_tokens=MAX_TOKENS)


def pulled_matrix(hooks: bool) -> dict:
    zero_copy_cases.force_pull(True)
    return cases.backend_matrix(("mnnvl",), ("standard",), 1, hooks, zero_copy=True, hidden=HIDDEN, num_sms=SMS,
                                max_tokens=MAX_TOKENS)


def grouped_worker(hooks: str) -> dict:
    return forced_grouped_worker(GROUPED_MODES, ("bf16+scales", "fp8"), MAX_TOKENS, 2100, hooks, num_sms=SMS,
                                 hidden=HIDDEN)


PUSHED = [f"mnnvl/{layout}/{p}/{s}" for layout in ("standard", "batched") for p in cases.PAYLOADS
          for s in cases.scenarios(2, MAX_TOKENS)]
PULLED = [f"mnnvl/standard/{p}/{s}" for p in cases.PAYLOADS for s in cases.scenarios(2, MAX_TOKENS)]
GROUPED = [f"{m}/{layout}/{p}/{s}" for m in GROUPED_MODES.values() for layout in ("standard", "batched")
           for p in ("bf16+scales", "fp8") for s in cases.scenarios(2, MAX_TOKENS)]


@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "recv_hooks"])
@pytest.mark.parametrize("case", PUSHED)
def test_pushed_combine_with_prefetching_sums_matches_oracle(case, hooks):
    _assert_clean(case, f"pushed_{hooks}", pushed_matrix, hooks)


@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "recv_hooks"])
@pytest.mark.parametrize("case", PULLED)
def test_pulled_combine_with_prefetching_sums_matches_oracle(case, hooks):
    _assert_clean(case, f"pulled_{hooks}", pulled_matrix, hooks)


@pytest.mark.parametrize("hooks", ["none", "even"])
@pytest.mark.parametrize("case", GROUPED)
def test_grouped_combine_with_prefetching_sums_matches_oracle(case, hooks):
    assert not [k for k in _run(f"grouped_{hooks}", grouped_worker, hooks) if k.endswith("switched_on")]
    _assert_clean(case, f"grouped_{hooks}", grouped_worker, hooks)
