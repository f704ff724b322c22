"""Ranks that take receive hooks next to ranks that do not, on GPUs, against the oracle.

Hooks are each rank's own choice: a hooked call's send and receive halves must follow the same
protocol as the whole call on a rank without a hook.  The grouped combine (per-group flags) is forced
on at 96 tokens, split (3 sending blocks) and interleaved; the even ranks hook both ops, the odd ones
do not.  Ranks and GPUs as in test_mnnvl.py.
"""
from __future__ import annotations

import pytest
import torch

from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .. import cases
from .grouped_cases import forced_grouped_worker

pytestmark = [pytest.mark.gpu]

MAX_TOKENS = 96
MODES = {"split:3": "split", "1": "interleaved"}  # $EP_COMM_COMBINE_GROUPED -> case name


def mixed_hooks_worker() -> dict:
    return forced_grouped_worker(MODES, ("bf16+scales",), MAX_TOKENS, 1300, hooks="even")


_cache: dict = {}


@pytest.mark.parametrize("case", [f"{m}/{layout}/bf16+scales/{s}" for m in MODES.values()
                                  for layout in ("standard", "batched") for s in cases.scenarios(2, MAX_TOKENS)])
def test_ranks_may_hook_or_not_independently(case):
    if not _cache:
        world, env = cases.kernel_test_world(torch.cuda.device_count() if torch.cuda.is_available() else 0)
        _cache.update(cases.merge_ranks(raise_on_failure(spawn_local(mixed_hooks_worker, world, timeout_s=600.0,
                                                                     extra_env=env))))
    assert not [k for k in _cache if k.endswith("switched_on")], sorted(_cache)
    assert case in _cache, sorted(_cache)[:8]
    assert _cache[case] == [], "\n".join(_cache[case])
