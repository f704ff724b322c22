"""The order of an eager collective dispatch (``naive``/``ag_rs``) on CPU ranks, recorded.

The host agreement comes after the call's local work (pack): a local failure is announced to the
peers like an input error, so nobody is left waiting inside the collective.  With ``validate_ids``
the out-of-range ids go as -1 and their count travels in the packed header; the host reads every
rank's count after the gather, so on a GPU it waits for the device only once the whole dispatch is
queued.  Nothing moves between ranks before the agreement, and a bad id raises on every rank.
``tests/test_communicator.py`` checks the errors' wording and the results against the oracle.
"""
from __future__ import annotations

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.backends.collective import flow, invalid_ids
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _record(comm, log: list[str], fail_pack: dict) -> None:
    """Log the pieces of a dispatch as they are called (this spawned process only)."""
    def wrap(owner, name, label=None, fail=None):
        fn = getattr(owner, name)

        def logged(*a, **k):
            log.append(label or name)
            if fail is not None and fail.pop("now", False):
                raise RuntimeError("pack failed (injected)")
            return fn(*a, **k)
        setattr(owner, name, logged)

    wrap(invalid_ids.InvalidIds, "route")
    wrap(invalid_ids.InvalidIds, "raise_if_any")
    wrap(flow, "pack", fail=fail_pack)
    wrap(comm.control, "agree_start", "agree")
    wrap(comm._impl, "gather")


def order_worker(backend: str) -> dict:
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    out: dict = {}
    for validate in (True, False):
        cfg = ep_comm.EPConfig(num_experts=4 * world, top_k=2, hidden=32, max_tokens_per_rank=8,
                               dtype=torch.bfloat16, backend=backend, validate_ids=validate, timeout_s=30.0)
        inputs = oracle.random_inputs(cfg, world, 11)
        mine = inputs[rank]
        log: list[str] = []
        fail_pack: dict = {}
        with ep_comm.Communicator(cfg) as comm:
            _record(comm, log, fail_pack)

            def call(ids=mine.topk_ids, *, mine=mine, log=log):
                log.clear()
                try:
                    d = comm.dispatch(mine.x, ids, mine.topk_weights)
                    raised = ""
                except Exception as exc:  # noqa: BLE001 - the type and text are what is checked
                    d, raised = None, f"{type(exc).__name__}: {exc}"
                return list(log), raised, d

            key = "on" if validate else "off"
            calls, raised, d = call()
            problems = oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs)[rank]) if d else []
            out[f"{key}/clean"] = (calls, raised, problems)
            if validate:
                bad = mine.topk_ids.clone()
                bad[0, 1] = cfg.num_experts + 7
                out[f"{key}/bad id on rank 1"] = call(bad if rank == 1 else mine.topk_ids)[:2]
            fail_pack["now"] = rank == 1
            out[f"{key}/pack fails on rank 1"] = call()[:2]
            calls, raised, d = call()  # still usable, still right
            problems = oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs)[rank]) if d else []
            out[f"{key}/after"] = (calls, raised, problems)
    return out


@pytest.mark.parametrize("backend", ["naive", "ag_rs"])
def test_eager_collective_dispatch_reads_the_id_counts_after_the_gather(backend):
    results = raise_on_failure(spawn_local(order_worker, 2, (backend,), timeout_s=120,
                                           extra_env=lambda r: CPU_ONLY))
    clean = ["route", "pack", "agree", "gather", "raise_if_any"]
    for rank, res in enumerate(results):
        # validation on: ids routed (invalid ones sent as -1 and counted), packed, agreed, gathered, then
        # every rank's count read
        assert res["on/clean"] == (clean, "", []), (rank, res["on/clean"])
        calls, raised = res["on/bad id on rank 1"]
        assert calls == clean, (rank, calls)  # the exchange went ahead with the bad id sent as -1 ...
        assert raised.startswith("EPInputError"), (rank, raised)  # ... and every rank raises after it
        if rank == 1:
            assert f"topk_ids[0, 1] = {4 * 2 + 7} on rank 1" in raised, raised
        else:
            assert "rank(s) [1]" in raised, raised
        for key in ("on", "off"):  # a local failure: the peers are told and raise; nobody waits in the gather
            calls, raised = res[f"{key}/pack fails on rank 1"]
            assert "gather" not in calls and calls[-1] == "agree", (rank, key, calls)
            if rank == 1:  # the local error itself, after the peers were told
                assert raised == "RuntimeError: pack failed (injected)", (key, raised)
            else:
                assert raised.startswith("EPInputError") and "rank 1" in raised, (key, raised)
        assert res["on/after"] == (clean, "", []), (rank, res["on/after"])
        # validation off: no report read; the agreement still follows the local work
        for key in ("off/clean", "off/after"):
            assert res[key] == (["route", "pack", "agree", "gather"], "", []), (rank, key, res[key])
