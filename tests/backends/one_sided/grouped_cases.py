"""The grouped combine forced on ($EP_COMM_COMBINE_GROUPED), run by test_mnnvl.py and
test_mixed_hooks.py: every scenario of every payload, twice per communicator (both parities), through
one communicator per (mode, layout, payload), each checked against the oracle.  The worker runs on every
rank of a spawned world (tests/backends/cases.py: ``init_rank``)."""
from __future__ import annotations

import os
from typing import Optional

import ep_comm
from ep_comm.backends.one_sided import layout as lay_mod
from ep_comm.backends.protocol import Cfg

from .. import cases


def forced_grouped_worker(modes: dict, payloads: tuple, max_tokens: int, seed: int, hooks: str = "none",
                          layouts: tuple = ("standard", "batched"), num_sms: Optional[int] = None,
                          hidden: int = cases.HIDDEN) -> dict:
    """``modes``: $EP_COMM_COMBINE_GROUPED value -> case name; ``hooks``: "none", "all" (every rank splits
    its calls with receive hooks) or "even" (the even ranks only); ``num_sms``: EPConfig.num_sms;
    ``hidden``: EPConfig.hidden.  Keys
    ``mode/layout/payload/scenario``; ``mode/layout/payload/switched_on`` instead when the mode did not
    take effect."""
    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    hooked = hooks == "all" or (hooks == "even" and rank % 2 == 0)
    out: dict = {}
    for env, mode in modes.items():
        os.environ[lay_mod.COMBINE_GROUPED_ENV] = env
        try:
            for layout in layouts:
                for payload in payloads:
                    cfg = cases.make_cfg(world, "mnnvl", layout, cases.PAYLOADS[payload][0], max_tokens=max_tokens,
                                         num_sms=num_sms, hidden=hidden)
                    with ep_comm.Communicator(cfg, device=device) as comm:
                        want = lay_mod.combine_grouped_mode(env, "0", comm.num_sms)
                        if comm._impl.kernels.cfg[Cfg.COMBINE_GROUPED] != want or want < 1:
                            out[f"{mode}/{layout}/{payload}/switched_on"] = [f"grouped mode {want} not switched on"]
                            continue
                        for _ in range(2):
                            for name, spec in cases.scenarios(world, max_tokens).items():
                                seed += 1
                                key = f"{mode}/{layout}/{payload}/{name}"
                                out[key] = out.get(key, []) + cases.run_case(comm, cfg, world, rank, seed, payload,
                                                                             spec, hooks=hooked)
        finally:
            del os.environ[lay_mod.COMBINE_GROUPED_ENV]
    return out
