"""Ranks that take receive hooks next to ranks that do not, on GPUs, against the oracle.

Hooks are each rank's own choice: a hooked call's send and receive halves must follow the same
protocol as the whole call on a rank without a hook.  The grouped combine (per-group flags) is forced
on at 96 tokens, split (3 sending blocks) and interleaved; the even ranks hook both ops, the odd ones
do not.  And next to hooked ranks, ranks whose one-launch dispatch lays rows out while it still sends
(2 SMs, up to 64 tokens: whole rows per warp from 17 tokens), so that rows written before their
header's code and rows marked landed meet on both sides; in the batched layout (receiving warps forced on
at world 2) also slots taken in landing order next to slots from the published counts.  Ranks and GPUs as
in test_mnnvl.py.
"""
from __future__ import annotations

import os
from unittest import mock

import pytest

import ep_comm
from ep_comm.backends.one_sided import layout as lay_mod

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


RWS_SMS, RWS_TOKENS = 2, 64
RWS_PAYLOADS = ("bf16+scales", "uint8_opaque")


def receiving_while_sending_worker() -> dict:
    """Copied rows, both layouts: the even ranks hook both ops, the odd ones do not."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    out: dict = {}
    seed = 1700
    # the batched layout receives while sending at world 2 too
    with mock.patch.dict(os.environ, {lay_mod.RECEIVE_WARPS_ENV: str(lay_mod.RECEIVE_WARPS_ONE_PEER)}):
        for layout in ("standard", "batched"):
            for payload in RWS_PAYLOADS:
                cfg = cases.make_cfg(world, "mnnvl", layout, cases.PAYLOADS[payload][0], max_tokens=RWS_TOKENS,
                                     num_sms=RWS_SMS)
                with ep_comm.Communicator(cfg, device=device) as comm:
                    for _ in range(2):  # both parities
                        for name, spec in cases.scenarios(world, RWS_TOKENS).items():
                            seed += 1
                            key = f"{layout}/{payload}/{name}"
                            out[key] = out.get(key, []) + cases.run_case(comm, cfg, world, rank, seed, payload, spec,
                                                                         hooks=rank % 2 == 0)
    return out


@pytest.mark.parametrize("case", [f"{layout}/{p}/{s}" for layout in ("standard", "batched") for p in RWS_PAYLOADS
                                  for s in cases.scenarios(2, RWS_TOKENS)])
def test_hooked_ranks_next_to_ranks_receiving_while_sending(case):
    _results.assert_clean(case, "receiving_while_sending", receiving_while_sending_worker)
