"""Ranks that take receive hooks next to ranks that do not, on GPUs, against the oracle.

Hooks are each rank's own choice: a hooked call's send and receive halves must follow the same
protocol as the whole call on a rank without a hook.  The grouped combine (per-group flags) is forced
on at 96 tokens, split (3 sending blocks) and interleaved; the even ranks hook both ops, the odd ones
do not.  Ranks and GPUs as in test_mnnvl.py.
"""
from __future__ import annotations

import os

import pytest
import torch

import ep_comm
from ep_comm.backends.one_sided import layout as lay_mod
from ep_comm.backends.protocol import Cfg
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .. import cases

pytestmark = [pytest.mark.gpu]

MAX_TOKENS = 96
MODES = {"split:3": "split", "1": "interleaved"}  # $EP_COMM_COMBINE_GROUPED -> case name


def mixed_hooks_worker() -> dict:
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    out: dict = {}
    seed = 1300
    for env, mode in MODES.items():
        os.environ[lay_mod.COMBINE_GROUPED_ENV] = env
        try:
            for layout in ("standard", "batched"):
                cfg = cases.make_cfg(world, "mnnvl", layout, None, max_tokens=MAX_TOKENS)
                with ep_comm.Communicator(cfg, device=device) as comm:
                    if comm._impl.kernels.cfg[Cfg.COMBINE_GROUPED] < 1:
                        out[f"{mode}/{layout}/switched_on"] = ["the grouped combine is not on"]
                        continue
                    for _ in range(2):  # both parities
                        for name, spec in cases.scenarios(world, MAX_TOKENS).items():
                            seed += 1
                            key = f"{mode}/{layout}/{name}"
                            out[key] = out.get(key, []) + cases.run_case(comm, cfg, world, rank, seed, "bf16+scales",
                                                                         spec, hooks=rank % 2 == 0)
        finally:
            del os.environ[lay_mod.COMBINE_GROUPED_ENV]
    return out


_cache: dict = {}


@pytest.mark.parametrize("case", [f"{m}/{layout}/{s}" for m in MODES.values() for layout in ("standard", "batched")
                                  for s in cases.scenarios(2, MAX_TOKENS)])
def test_ranks_may_hook_or_not_independently(case):
    if not _cache:
        world, env = cases.kernel_test_world(torch.cuda.device_count() if torch.cuda.is_available() else 0)
        _cache.update(cases.merge_ranks(raise_on_failure(spawn_local(mixed_hooks_worker, world, timeout_s=600.0,
                                                                     extra_env=env))))
    assert not [k for k in _cache if k.endswith("switched_on")], sorted(_cache)
    assert case in _cache, sorted(_cache)[:8]
    assert _cache[case] == [], "\n".join(_cache[case])
