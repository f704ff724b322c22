"""The grouped combine forced on ($EP_COMM_COMBINE_GROUPED), run by test_mnnvl.py and
test_mixed_hooks.py: every scenario of every payload, twice per communicator (both parities), through
one communicator per (mode, layout, payload), each checked against the oracle.  The worker runs on every
rank of a spawned world (tests/backends/cases.py: ``init_rank``)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional
from unittest import mock

import ep_comm
from ep_comm.backends.one_sided import layout as lay_mod
from ep_comm.backends.protocol import Cfg

from .. import cases


@contextlib.contextmanager
def grouped_env(key: str) -> Iterator[str]:
    """$EP_COMM_COMBINE_GROUPED and, after a space in ``key``, $EP_COMM_COMBINE_SUM_WARPS ("1 0": the
    interleaved combine with every warp sending and summing in turn) for the block; yields the former."""
    grouped, _, sum_warps = key.partition(" ")
    values = {lay_mod.COMBINE_GROUPED_ENV: grouped, **({lay_mod.SUM_WARPS_ENV: sum_warps} if sum_warps else {})}
    # restored as they were after the block: a count set for the whole run reaches keys that name none
    with mock.patch.dict(os.environ, values):
        yield grouped


def forced_grouped_worker(modes: dict, payloads: tuple, max_tokens: int, seed: int, hooks: str = "none",
                          layouts: tuple = ("standard", "batched"), num_sms: Optional[int] = None,
                          hidden: int = cases.HIDDEN) -> dict:
    """``modes``: ``grouped_env`` key -> case name; ``hooks``: "none", "all" (every rank splits
    its calls with receive hooks) or "even" (the even ranks only); ``num_sms``: EPConfig.num_sms;
    ``hidden``: EPConfig.hidden.  Keys
    ``mode/layout/payload/scenario``; ``mode/layout/payload/switched_on`` instead when the mode did not
    take effect."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    hooked = hooks == "all" or (hooks == "even" and rank % 2 == 0)
    out: dict = {}
    for key, mode in modes.items():
        with grouped_env(key) as env:
            for layout in layouts:
                for payload in payloads:
                    cfg = cases.make_cfg(world, "mnnvl", layout, cases.PAYLOADS[payload][0], max_tokens=max_tokens,
                                         num_sms=num_sms, hidden=hidden)
                    with ep_comm.Communicator(cfg, device=device) as comm:
                        want = lay_mod.combine_grouped_mode(env, "0", comm.num_sms)
                        got = comm._impl.kernels.cfg
                        if got[Cfg.COMBINE_GROUPED] != want or want < 1 or \
                                got[Cfg.COMBINE_SUM_WARPS] != lay_mod.combine_sum_warps(want):
                            out[f"{mode}/{layout}/{payload}/switched_on"] = [f"grouped mode {want} not switched on"]
                            continue
                        for _ in range(2):
                            for name, spec in cases.scenarios(world, max_tokens).items():
                                seed += 1
                                key = f"{mode}/{layout}/{payload}/{name}"
                                out[key] = out.get(key, []) + cases.run_case(comm, cfg, world, rank, seed, payload,
                                                                             spec, hooks=hooked)
    return out
