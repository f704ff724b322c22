"""Ranks that take receive hooks next to ranks that do not, on GPUs, against the oracle.

Hooks are each rank's own choice: a hooked call's send and receive halves must follow the same
protocol as the whole call on a rank without a hook.  The grouped combine (per-group flags) is forced
on at 96 tokens, split (3 sending blocks) and interleaved; the even ranks hook both ops, the odd ones
do not.  Ranks and GPUs as in test_mnnvl.py.
"""
from __future__ import annotations

import pytest

from .. import cases
from . import spawned
from .grouped_cases import forced_grouped_worker

pytestmark = [pytest.mark.gpu]

MAX_TOKENS = 96
MODES = {"split:3": "split", "1": "interleaved"}  # $EP_COMM_COMBINE_GROUPED -> case name


def mixed_hooks_worker() -> dict:
    return forced_grouped_worker(MODES, ("bf16+scales",), MAX_TOKENS, 1300, hooks="even")


_results = spawned.CaseResults()


@pytest.mark.parametrize("case", [f"{m}/{layout}/bf16+scales/{s}" for m in MODES.values()
                                  for layout in ("standard", "batched") for s in cases.scenarios(2, MAX_TOKENS)])
def test_ranks_may_hook_or_not_independently(case):
    results = _results.results("mixed_hooks", mixed_hooks_worker)
    assert not [k for k in results if k.endswith("switched_on")], sorted(results)
    _results.assert_clean(case, "mixed_hooks", mixed_hooks_worker)
