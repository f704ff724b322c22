"""Communicator-level behaviour on gloo: typed errors on every rank, no hangs, timeouts, epochs."""
import os
import time

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def _cfg(world, **kw):
    base = dict(num_experts=4 * world, top_k=3, hidden=128, max_tokens_per_rank=8, dtype=torch.bfloat16,
                layout="standard", backend="naive", timeout_s=30.0)
    base.update(kw)
    return ep_comm.EPConfig(**base)


def _good(cfg, world, rank, seed=5):
    return oracle.random_inputs(cfg, world, seed)[rank]


# Each entry: name -> function(cfg, good RankInput) returning dispatch kwargs with one bad argument.
BAD_DISPATCH = {
    "x wrong hidden": lambda c, g: dict(x=torch.randn(4, c.hidden + 1).to(c.dtype), topk_ids=g.topk_ids[:4],
                                        topk_weights=g.topk_weights[:4]),
    "x 3-D": lambda c, g: dict(x=g.x.unsqueeze(0), topk_ids=g.topk_ids, topk_weights=g.topk_weights),
    "x fp32 vs bf16 config": lambda c, g: dict(x=g.x.float(), topk_ids=g.topk_ids, topk_weights=g.topk_weights),
    "x on meta device": lambda c, g: dict(x=g.x.to("meta"), topk_ids=g.topk_ids, topk_weights=g.topk_weights),
    "T above max": lambda c, g: dict(x=torch.randn(c.max_tokens_per_rank + 1, c.hidden).to(c.dtype),
                                     topk_ids=torch.zeros(c.max_tokens_per_rank + 1, c.top_k, dtype=torch.int32),
                                     topk_weights=torch.ones(c.max_tokens_per_rank + 1, c.top_k)),
    "ids float dtype": lambda c, g: dict(x=g.x, topk_ids=g.topk_ids.float(), topk_weights=g.topk_weights),
    "ids wrong k": lambda c, g: dict(x=g.x, topk_ids=g.topk_ids[:, :2], topk_weights=g.topk_weights),
    "weights fp16": lambda c, g: dict(x=g.x, topk_ids=g.topk_ids, topk_weights=g.topk_weights.half()),
    "weights wrong T": lambda c, g: dict(x=g.x, topk_ids=g.topk_ids, topk_weights=g.topk_weights[:-1]),
    "id too large": lambda c, g: dict(x=g.x,
                                      topk_ids=torch.where(torch.arange(g.topk_ids.numel()).view_as(g.topk_ids) == 4,
                                                           c.num_experts, g.topk_ids).int(),
                                      topk_weights=g.topk_weights),
    "id below -1": lambda c, g: dict(x=g.x, topk_ids=torch.full_like(g.topk_ids, -3), topk_weights=g.topk_weights),
    "x_scales wrong T": lambda c, g: dict(x=g.x, topk_ids=g.topk_ids, topk_weights=g.topk_weights,
                                          x_scales=torch.ones(2, 3)),
    "opaque payload too wide": lambda c, g: dict(x=torch.zeros(g.x.shape[0], c.hidden * 2 + 1, dtype=torch.uint8),
                                                 topk_ids=g.topk_ids, topk_weights=g.topk_weights),
    "x not a tensor": lambda c, g: dict(x=[[1.0]], topk_ids=g.topk_ids, topk_weights=g.topk_weights),
}


def bad_dispatch_worker(backend: str):
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    cfg = _cfg(world, backend=backend)
    out = {}
    with ep_comm.Communicator(cfg) as comm:
        for name, make in BAD_DISPATCH.items():
            good = _good(cfg, world, rank)
            args = (make(cfg, good) if rank == 0
                    else dict(x=good.x, topk_ids=good.topk_ids, topk_weights=good.topk_weights))
            t0 = time.monotonic()
            try:
                comm.dispatch(**args)
                out[name] = ("no error", "", 0.0)
            except Exception as exc:  # noqa: BLE001 - we report the type
                out[name] = (type(exc).__name__, str(exc), time.monotonic() - t0)
        # the communicator is still usable after every rejected call
        good = _good(cfg, world, rank, seed=9)
        d = comm.dispatch(good.x, good.topk_ids, good.topk_weights)
        y = comm.combine(oracle.run_experts(cfg, rank, world, d), d)
        out["recovered"] = oracle.compare_combine(
            cfg, y, oracle.expected_combine(cfg, oracle.random_inputs(cfg, world, 9))[rank])
    return out


@pytest.mark.parametrize("backend", ["naive", "ag_rs"])
def test_bad_dispatch_input_raises_typed_error_on_every_rank(backend):
    results = raise_on_failure(spawn_local(bad_dispatch_worker, 2, (backend,), timeout_s=180,
                                           extra_env=lambda r: CPU_ONLY))
    for rank, res in enumerate(results):
        assert res.pop("recovered") == []
        for name, (etype, msg, secs) in res.items():
            assert etype == "EPInputError", f"rank {rank}, {name}: got {etype}: {msg}"
            assert secs < 10, f"rank {rank}, {name}: took {secs:.1f}s"
            if rank == 1:
                assert "rank(s) [0]" in msg, msg
    r0 = results[0]
    assert "topk_ids[1, 1] = 8 on rank 0" in r0["id too large"][1]
    assert "-3" in r0["id below -1"][1]
    assert "max_tokens_per_rank=8" in r0["T above max"][1]
    assert "meta" in r0["x on meta device"][1]


@pytest.mark.parametrize("backend", ["naive", "ag_rs"])
def test_one_rank_communicator_checks_input_and_matches_the_oracle(backend):
    """One rank skips the host exchange: bad input still raises, and the next call is still right."""
    (res,) = raise_on_failure(spawn_local(bad_dispatch_worker, 1, (backend,), timeout_s=120,
                                          extra_env=lambda r: CPU_ONLY))
    assert res.pop("recovered") == []
    for name, (etype, msg, _) in res.items():
        assert etype == "EPInputError", f"{name}: got {etype}: {msg}"


def bad_combine_worker():
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    out = {}
    for layout in ("standard", "batched"):
        cfg = _cfg(world, layout=layout)
        with ep_comm.Communicator(cfg) as comm:
            good = _good(cfg, world, rank)
            d = comm.dispatch(good.x, good.topk_ids, good.topk_weights)
            eo = oracle.run_experts(cfg, rank, world, d)
            bad = {
                "wrong shape": dict(expert_out=eo[..., :-1], dispatched=d),
                "int dtype": dict(expert_out=eo.to(torch.int32), dispatched=d),
                "not a Dispatched": dict(expert_out=eo, dispatched=object()),
                "out wrong dtype": dict(expert_out=eo, dispatched=d, out=torch.empty(d.num_tokens, cfg.hidden)),
            }
            for name, kw in bad.items():
                if rank != 0:
                    kw = dict(expert_out=eo, dispatched=d)
                try:
                    comm.combine(**kw)
                    out[f"{layout}/{name}"] = "no error"
                except Exception as exc:  # noqa: BLE001
                    out[f"{layout}/{name}"] = type(exc).__name__
            y = comm.combine(eo, d)
            out[f"{layout}/recovered"] = y.shape == (d.num_tokens, cfg.hidden)
    return out


def test_bad_combine_input_raises_on_every_rank():
    results = raise_on_failure(spawn_local(bad_combine_worker, 2, timeout_s=120, extra_env=lambda r: CPU_ONLY))
    for rank, res in enumerate(results):
        for name, value in res.items():
            if name.endswith("recovered"):
                assert value is True
            else:
                assert value == "EPInputError", f"rank {rank} {name}: {value}"


def indivisible_worker():
    ep_comm.init_distributed()
    try:
        ep_comm.Communicator(ep_comm.EPConfig(num_experts=6, top_k=2, hidden=128, max_tokens_per_rank=4,
                                              backend="naive"))
    except ep_comm.EPConfigError as exc:
        return str(exc)
    return "no error"


def test_num_experts_not_divisible_by_world():
    for msg in raise_on_failure(spawn_local(indivisible_worker, 4, timeout_s=60, extra_env=lambda r: CPU_ONLY)):
        assert "num_experts" in msg and "world size 4" in msg


def missing_peer_worker(absent_rank: int):
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    cfg = _cfg(world, timeout_s=3.0)
    comm = ep_comm.Communicator(cfg)
    shm = comm.control._shm is not None
    if rank == absent_rank:
        time.sleep(8.0)  # never calls dispatch
        return ("absent", None, 0.0, shm)
    good = _good(cfg, world, rank)
    t0 = time.monotonic()
    try:
        comm.dispatch(good.x, good.topk_ids, good.topk_weights)
        return ("no error", None, time.monotonic() - t0, shm)
    except ep_comm.EPTimeoutError as exc:
        return (str(exc), list(exc.missing_ranks), time.monotonic() - t0, shm)


# one host: the agreement goes through shared memory; EP_COMM_SHM_AGREE=0 keeps it on gloo
AGREEMENT = {"shm": CPU_ONLY, "gloo": {**CPU_ONLY, "EP_COMM_SHM_AGREE": "0"}}


@pytest.mark.parametrize("agreement", sorted(AGREEMENT))
def test_missing_peer_times_out_naming_it_on_every_waiting_rank(agreement):
    results = raise_on_failure(spawn_local(missing_peer_worker, 3, (2,), timeout_s=120,
                                           extra_env=lambda r: AGREEMENT[agreement]))
    for rank in (0, 1):
        msg, missing, secs, shm = results[rank]
        assert shm == (agreement == "shm")
        assert missing == [2], f"rank {rank}: {msg}"
        assert "rank 2" in msg and "never arrived" in msg
        assert 2.5 < secs < 15, secs
    assert results[2][0] == "absent"


def epoch_mismatch_worker():
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    cfg = _cfg(world)
    comm = ep_comm.Communicator(cfg)
    good = _good(cfg, world, rank)
    d = comm.dispatch(good.x, good.topk_ids, good.topk_weights)
    try:
        if rank == 0:
            comm.combine(oracle.run_experts(cfg, rank, world, d), d)
        else:  # out of step: a second dispatch where rank 0 combines
            comm.dispatch(good.x, good.topk_ids, good.topk_weights)
        return "no error"
    except ep_comm.EPTimeoutError as exc:
        return f"timeout: {exc}"
    except ep_comm.EPError as exc:
        return str(exc)


def test_peer_on_another_call_is_detected_not_mixed():
    results = raise_on_failure(spawn_local(epoch_mismatch_worker, 2, timeout_s=60, extra_env=lambda r: CPU_ONLY))
    for rank, msg in enumerate(results):
        assert "epoch" in msg and "same order" in msg, f"rank {rank}: {msg}"
        other = 1 - rank
        assert f"rank {other} is in" in msg


def close_worker():
    topo = ep_comm.init_distributed()
    cfg = _cfg(topo.world_size)
    comm = ep_comm.Communicator(cfg)
    comm.close()
    comm.close()  # idempotent
    good = _good(cfg, topo.world_size, topo.rank)
    try:
        comm.dispatch(good.x, good.topk_ids, good.topk_weights)
    except ep_comm.EPError as exc:
        return str(exc)
    return "no error"


def test_closed_communicator_refuses_calls():
    for msg in raise_on_failure(spawn_local(close_worker, 2, timeout_s=60, extra_env=lambda r: CPU_ONLY)):
        assert "closed" in msg


def hooks_worker(backend: str) -> list[str]:
    topo = ep_comm.init_distributed()
    cfg = _cfg(topo.world_size, backend=backend)
    good = _good(cfg, topo.world_size, topo.rank)
    out = []
    with ep_comm.Communicator(cfg) as comm:
        try:
            comm.dispatch(good.x, good.topk_ids, good.topk_weights, return_recv_hook=True)
            out.append("no error")
        except ep_comm.EPConfigError as exc:
            out.append(str(exc))
        d = comm.dispatch(good.x, good.topk_ids, good.topk_weights)  # still usable: nothing was sent
        eo = torch.zeros(*d.x.shape[:-1], cfg.hidden, dtype=cfg.dtype)
        try:
            comm.combine(eo, d, return_recv_hook=True)
            out.append("no error")
        except ep_comm.EPConfigError as exc:
            out.append(str(exc))
        comm.combine(eo, d)
    return out


@pytest.mark.parametrize("backend", ["naive", "ag_rs"])
def test_collective_backends_refuse_recv_hooks_naming_the_backend_that_has_them(backend):
    for msgs in raise_on_failure(spawn_local(hooks_worker, 2, (backend,), timeout_s=60, extra_env=lambda r: CPU_ONLY)):
        assert len(msgs) == 2
        for msg in msgs:
            assert "return_recv_hook" in msg and backend in msg and "'mnnvl'" in msg, msg


def attributes_worker():
    topo = ep_comm.init_distributed()
    cfg = _cfg(topo.world_size, backend="auto")
    with ep_comm.Communicator(cfg) as comm:
        return dict(rank=comm.rank, world=comm.world_size, L=comm.num_local_experts, backend=comm.backend,
                    capacity=comm.capacity)


def test_attributes_and_auto_backend(monkeypatch):
    res = raise_on_failure(spawn_local(attributes_worker, 2, timeout_s=60, extra_env=lambda r: CPU_ONLY))
    assert [r["rank"] for r in res] == [0, 1]
    for r in res:
        assert r == dict(rank=r["rank"], world=2, L=4, backend="ag_rs", capacity=16)
    res = raise_on_failure(spawn_local(attributes_worker, 2, timeout_s=60,
                                       extra_env=lambda r: {**CPU_ONLY, "EP_COMM_BACKEND": "naive"}))
    assert {r["backend"] for r in res} == {"naive"}


def fall_through_worker(error: str):
    """``auto`` over a first backend whose creation fails alike on every rank."""
    import warnings

    from ep_comm import backends
    from ep_comm.backends.collective import NaiveBackend

    class Refusing(NaiveBackend):
        name = "refusing"

        @classmethod
        def create(cls, ctx):
            if error == "timeout":
                raise ep_comm.EPTimeoutError("peer 1 never came", missing_ranks=[1])
            raise ep_comm.EPError("NVSHMEM failed to start (status 7)")

    backends.register(Refusing)
    backends.AUTO_ORDER = ("refusing", "ag_rs")
    topo = ep_comm.init_distributed()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ep_comm.Communicator(_cfg(topo.world_size, backend="auto")) as comm:
                return dict(backend=comm.backend, skipped=comm.auto_skipped,
                            warned=[str(w.message) for w in caught if w.category is RuntimeWarning])
    except ep_comm.EPError as exc:
        return dict(raised=type(exc).__name__)


def test_auto_falls_through_a_backend_whose_creation_fails_on_every_rank():
    for res in raise_on_failure(spawn_local(fall_through_worker, 2, ("error",), timeout_s=60,
                                            extra_env=lambda r: CPU_ONLY)):
        assert res["backend"] == "ag_rs", res
        assert len(res["skipped"]) == 1 and "refusing" in res["skipped"][0] and "status 7" in res["skipped"][0]
        assert any("skips 'refusing'" in w for w in res["warned"]), res
    # a missing peer is not a reason to try the next backend: it would be missing there too
    for res in raise_on_failure(spawn_local(fall_through_worker, 2, ("timeout",), timeout_s=60,
                                            extra_env=lambda r: CPU_ONLY)):
        assert res == {"raised": "EPTimeoutError"}, res


def subgroup_worker():
    import torch.distributed as dist

    topo = ep_comm.init_distributed()
    # every rank creates both subgroups (torch's rule); each rank then uses only its own
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[topo.rank // 2]
    sub_rank, sub_world = dist.get_rank(mine), dist.get_world_size(mine)
    cfg = _cfg(sub_world, layout="batched" if topo.rank < 2 else "standard", backend="ag_rs")
    inputs = oracle.random_inputs(cfg, sub_world, seed=50 + topo.rank // 2, tokens=[5, 8])
    with ep_comm.Communicator(cfg, group=mine) as comm:
        inp = inputs[sub_rank]
        problems = []
        for _ in range(2):
            d = comm.dispatch(inp.x, inp.topk_ids, inp.topk_weights)
            problems += oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs)[sub_rank])
            y = comm.combine(oracle.run_experts(cfg, sub_rank, sub_world, d), d)
            problems += oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, sub_rank))
        return (comm.rank, comm.world_size, problems)


def test_communicator_over_subgroups():
    res = raise_on_failure(spawn_local(subgroup_worker, 4, timeout_s=120, extra_env=lambda r: CPU_ONLY))
    assert [(r, w) for r, w, _ in res] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    for rank, (_, _, problems) in enumerate(res):
        assert problems == [], f"rank {rank}: {problems}"


def mismatched_settings_worker(what: str):
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    cfg = _cfg(world)
    if rank == 1 and what == "hidden":
        cfg = cfg.replace(hidden=cfg.hidden + 8)
    if rank == 1 and what == "zero_copy":  # rows left in place on one rank, copied out on another
        cfg = cfg.replace(zero_copy=True)
    if rank == 1 and what == "env":
        os.environ["EP_COMM_COMBINE_GROUPED"] = "split"
    if rank == 1 and what == "pull_env":  # a zero-copy combine pulling on some ranks, pushing on others
        os.environ["EP_COMM_COMBINE_PULL"] = "0"
    try:
        with ep_comm.Communicator(cfg):
            return ("created", "")
    except ep_comm.EPConfigError as exc:
        return (type(exc).__name__, str(exc))


@pytest.mark.parametrize("what", ["hidden", "zero_copy", "env", "pull_env"])
def test_ranks_with_different_settings_are_refused_on_every_rank(what):
    """A field that shapes what ranks exchange (or a protocol knob in the environment) that differs
    between ranks would corrupt data or hang: creation raises on every rank, naming it and the ranks."""
    results = raise_on_failure(spawn_local(mismatched_settings_worker, 3, (what,), timeout_s=120,
                                           extra_env=lambda r: CPU_ONLY))
    name = {"env": "$EP_COMM_COMBINE_GROUPED=", "pull_env": "$EP_COMM_COMBINE_PULL="}.get(what, f"EPConfig.{what}=")
    for rank, (kind, msg) in enumerate(results):
        assert kind == "EPConfigError", (rank, kind, msg)
        assert msg.startswith(name) and "ranks 0, 2" in msg and "rank 1:" in msg, (rank, msg)


def buffer_helpers_worker(backend: str, layout: str, zero_copy: bool) -> list[str]:
    topo = ep_comm.init_distributed()
    world, rank = topo.world_size, topo.rank
    cfg = _cfg(world, backend=backend, layout=layout, zero_copy=zero_copy)
    problems: list[str] = []
    with ep_comm.Communicator(cfg) as comm:
        try:
            comm.expert_output_buffer(object())
            problems.append("a foreign `dispatched` was accepted")
        except ep_comm.EPInputError:
            pass
        for seed in (3, 4):
            inputs = oracle.random_inputs(cfg, world, seed)
            x_buf = comm.dispatch_input_buffer()
            if tuple(x_buf.shape) != (cfg.max_tokens_per_rank, cfg.hidden) or x_buf.dtype != cfg.dtype:
                problems.append(f"input buffer shape {tuple(x_buf.shape)} dtype {x_buf.dtype}")
                continue
            if comm.dispatch_input_buffer() is not x_buf:
                problems.append("the input buffer is not the same tensor on every call")
            x = x_buf[: inputs[rank].x.shape[0]]
            x.copy_(inputs[rank].x)
            d = comm.dispatch(x, inputs[rank].topk_ids, inputs[rank].topk_weights)
            problems += oracle.compare_dispatch(cfg, d, oracle.expected_dispatch(cfg, inputs)[rank])
            buf = comm.expert_output_buffer(d)
            expected_shape = tuple(d.x.shape[:2]) + (cfg.hidden,) if layout == "batched" else (d.x.shape[0], cfg.hidden)
            if tuple(buf.shape) != expected_shape or buf.dtype != cfg.dtype:
                problems.append(f"shape {tuple(buf.shape)} dtype {buf.dtype}, expected {expected_shape} {cfg.dtype}")
                continue
            buf.copy_(oracle.run_experts(cfg, rank, world, d))
            y = comm.combine(buf, d)
            problems += oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))
    return problems


@pytest.mark.parametrize("backend,layout,zero_copy", [("naive", "standard", False), ("ag_rs", "batched", False),
                                                      ("ag_rs", "standard", True)])
def test_buffer_helpers_give_every_backend_tensors_to_write_inputs_and_expert_outputs_into(backend, layout, zero_copy):
    """Off the kernel backends' zero copy, ``dispatch_input_buffer`` is a new ``[max_tokens, hidden]``
    tensor and ``expert_output_buffer`` a new tensor of expert_out's shape: the same engine code runs
    on every backend (the kernel backends' in-place buffers are tested on GPUs)."""
    for problems in raise_on_failure(spawn_local(buffer_helpers_worker, 2, (backend, layout, zero_copy),
                                                 timeout_s=120, extra_env=lambda r: CPU_ONLY)):
        assert problems == [], "\n".join(problems)


def malformed_switch_worker(name: str, value: str):
    os.environ[name] = value
    topo = ep_comm.init_distributed()
    try:
        with ep_comm.Communicator(_cfg(topo.world_size, backend="auto")):
            return ("created", "")
    except ep_comm.EPConfigError as exc:
        return (type(exc).__name__, str(exc))


@pytest.mark.parametrize("name,value", [("EP_COMM_COMBINE_PULL", "yes"), ("EP_COMM_COMBINE_GROUPED", "split:x")])
def test_a_malformed_protocol_switch_is_a_config_error_on_every_rank(name, value):
    """Not a backend that cannot start (which backend="auto" would skip with a warning): every rank
    raises, naming the variable."""
    for kind, msg in raise_on_failure(spawn_local(malformed_switch_worker, 2, (name, value), timeout_s=120,
                                                  extra_env=lambda r: CPU_ONLY)):
        assert kind == "EPConfigError" and msg.startswith(f"${name}={value!r}"), msg
