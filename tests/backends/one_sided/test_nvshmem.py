"""The nvshmem backend on GPUs: the oracle matrix (plain and with receive hooks), CUDA graphs, all of it
again in put mode (NVSHMEM puts and signals forced on NVLink peers), a rank that skips a call,
NVSHMEM's start/stop across communicators, and the backend choice.

One rank per GPU (NVSHMEM gives each GPU one PE), so at least 2 GPUs; skipped without them or without
the ``ep_comm._C_nvshmem`` extension (built where the NVSHMEM wheel is installed).
"""
from __future__ import annotations

import os

import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .. import cases, zero_copy_cases
from . import spawned
from .kernel_fault_cases import (
    RECREATE_CYCLES,
    bad_input_recovery_worker,
    check_recreated,
    check_skipper_named,
    compile_worker,
    recreate_after_timeout_worker,
    skip_worker,
    validation_off_recovery_worker,
)


def _why_skip() -> str:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs at least 2 CUDA GPUs (one NVSHMEM PE per GPU)"
    from ep_comm.memory import nvshmem_heap

    return nvshmem_heap.unavailable_reason()


pytestmark = [pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.skipif(bool(_why_skip()), reason=_why_skip() or "-")]


def _spawn(fn, *args, timeout_s: float = 600.0, env: dict | None = None):
    world = torch.cuda.device_count()
    extra = None if env is None else (lambda rank: env)
    return raise_on_failure(spawn_local(fn, world, args=args, timeout_s=timeout_s, extra_env=extra,
                                        preload=spawned.PRELOAD))


_cache: dict = {}
PUT = {"EP_COMM_NVSHMEM_PUT": "1"}  # NVSHMEM puts and signals instead of stores to NVLink peers


def _assert_clean(case, name, fn, *args, env: dict | None = None):
    """``case`` is among the cases ``fn`` ran (on every rank, once per module) and had no problems."""
    if name not in _cache:
        _cache[name] = cases.merge_ranks(_spawn(fn, *args, env=env))
    results = _cache[name]
    assert case in results
    assert results[case] == [], "\n".join(results[case])


MATRIX = [f"nvshmem/{layout}/{p}/{s}" for layout in ("standard", "batched") for p in cases.PAYLOADS
          for s in cases.scenarios(2, 16)]
GRAPH = [f"nvshmem/{layout}/{q}" for layout in ("standard", "batched") for q in ("bf16", "fp8")]


@pytest.mark.parametrize("case", MATRIX)
def test_matches_oracle(case):
    # two rounds per communicator: buffers reused without a barrier; one communicator per
    # (layout, payload), so NVSHMEM is started and finalised six times in each rank's process
    _assert_clean(case, "matrix", cases.backend_matrix, ("nvshmem",), ("standard", "batched"), 2)


@pytest.mark.parametrize("case", MATRIX)
def test_recv_hooks_match_oracle(case):
    _assert_clean(case, "hooks", cases.backend_matrix, ("nvshmem",), ("standard", "batched"), 1, True)


@pytest.mark.parametrize("case", GRAPH)
def test_cuda_graph_capture_and_replay(case):
    _assert_clean(case, "graph", cases.graph_capture, ("nvshmem",))


@pytest.mark.parametrize("case", GRAPH)
def test_recv_hooks_under_cuda_graphs(case):
    _assert_clean(case, "hooks_graph", cases.graph_capture, ("nvshmem",), ("standard", "batched"), 3, True)


# -- put mode: the network path (staging rows, NVSHMEM puts and signals), forced on NVLink peers -------------
@pytest.mark.parametrize("case", MATRIX)
def test_put_mode_matches_oracle(case):
    _assert_clean(case, "put_matrix", cases.backend_matrix, ("nvshmem",), ("standard", "batched"), 2, env=PUT)


@pytest.mark.parametrize("case", MATRIX)
def test_put_mode_recv_hooks_match_oracle(case):
    _assert_clean(case, "put_hooks", cases.backend_matrix, ("nvshmem",), ("standard", "batched"), 1, True, env=PUT)


@pytest.mark.parametrize("case", GRAPH)
def test_put_mode_cuda_graphs(case):
    _assert_clean(case, "put_graph", cases.graph_capture, ("nvshmem",), env=PUT)


ZERO_COPY = zero_copy_cases.zero_copy_case_names("nvshmem")


@pytest.mark.parametrize("case", ZERO_COPY)
def test_zero_copy_matches_oracle(case):
    _assert_clean(case, "zero_copy", zero_copy_cases.zero_copy_matrix, ("nvshmem",))


@pytest.mark.parametrize("case", ZERO_COPY)
def test_zero_copy_put_mode_matches_oracle(case):
    _assert_clean(case, "zero_copy_put", zero_copy_cases.zero_copy_matrix, ("nvshmem",), env=PUT)


@pytest.mark.parametrize("case", ZERO_COPY)
def test_zero_copy_recv_hooks_match_oracle(case):
    _assert_clean(case, "zero_copy_hooks", zero_copy_cases.zero_copy_matrix, ("nvshmem",), True)


@pytest.mark.parametrize("case", ["nvshmem/standard/bf16", "nvshmem/standard/fp8"])
def test_zero_copy_under_cuda_graphs(case):
    _assert_clean(case, "zero_copy_graph", zero_copy_cases.zero_copy_graphs, ("nvshmem",))


@pytest.mark.parametrize("case", ["nvshmem/standard/bf16", "nvshmem/standard/fp8"])
def test_zero_copy_recv_hooks_under_cuda_graphs_in_put_mode(case):
    _assert_clean(case, "zero_copy_hooks_graph_put", zero_copy_cases.zero_copy_graphs, ("nvshmem",), True, env=PUT)


@pytest.mark.parametrize("case", cases.wide_rows_case_names("nvshmem", ("standard", "batched")))
def test_rows_in_several_pieces_in_put_mode(case):
    """Rows copied out in pieces, every payload and layout, the rows put by NVSHMEM."""
    _assert_clean(case, "wide_put", cases.wide_rows_matrix, ("nvshmem",), env=PUT)


@pytest.mark.parametrize("case", cases.wide_rows_case_names("nvshmem"))
def test_zero_copy_rows_in_several_pieces_match_oracle(case):
    _assert_clean(case, "zero_copy_wide", zero_copy_cases.zero_copy_wide_rows, ("nvshmem",))


@pytest.mark.parametrize("case", cases.wide_rows_case_names("nvshmem"))
def test_zero_copy_rows_in_several_pieces_in_put_mode(case):
    _assert_clean(case, "zero_copy_wide_put", zero_copy_cases.zero_copy_wide_rows, ("nvshmem",), env=PUT)


@pytest.mark.parametrize("case", zero_copy_cases.zero_copy_shapes_case_names("nvshmem"))
def test_zero_copy_top_k_and_long_rows_match_oracle(case):
    """top_k 1, 3, 6, 8 and 600 rows per rank on one SM, pulled and pushed."""
    _assert_clean(case, "zero_copy_shapes", zero_copy_cases.zero_copy_shapes, ("nvshmem",))


@pytest.mark.parametrize("case", zero_copy_cases.zero_copy_shapes_case_names("nvshmem"))
def test_zero_copy_top_k_and_long_rows_in_put_mode(case):
    _assert_clean(case, "zero_copy_shapes_put", zero_copy_cases.zero_copy_shapes, ("nvshmem",), env=PUT)


IN_PLACE = zero_copy_cases.zero_copy_case_names("nvshmem", in_place=True)


@pytest.mark.parametrize("case", IN_PLACE)
def test_zero_copy_input_in_place_matches_oracle(case):
    _assert_clean(case, "in_place", zero_copy_cases.zero_copy_matrix, ("nvshmem",), False, True, True)


@pytest.mark.parametrize("case", IN_PLACE)
def test_zero_copy_input_in_place_in_put_mode(case):
    _assert_clean(case, "in_place_put", zero_copy_cases.zero_copy_matrix, ("nvshmem",), False, True, True, env=PUT)


@pytest.mark.parametrize("case", ["nvshmem/standard/bf16"])  # (fp8: the input buffer is a tensor of its own)
def test_zero_copy_input_in_place_under_cuda_graphs(case):
    _assert_clean(case, "in_place_graph", zero_copy_cases.zero_copy_graphs, ("nvshmem",), False, True)


@pytest.mark.parametrize("case", cases.wide_rows_case_names("nvshmem"))
def test_zero_copy_input_in_place_in_several_pieces(case):
    _assert_clean(case, "in_place_wide", zero_copy_cases.zero_copy_wide_rows, ("nvshmem",), False, True)


def test_rank_that_skips_a_call_is_named_by_a_timeout():
    timeout_s = 3.0
    results = _spawn(skip_worker, timeout_s, "nvshmem", timeout_s=120)
    world = len(results)
    for res in results[:-1]:
        check_skipper_named(res, world)
        assert res["elapsed"] < timeout_s + 5, res
        assert res["later"] == "EPTimeoutError", res
    # after a timeout close frees nothing collectively (nvshmem_free would wait for the peer)
    assert all(r["close_s"] < timeout_s + 30 for r in results), results


def lifecycle_worker() -> dict:
    """Two communicators open at once share one NVSHMEM; it stays running, idle, after the last closes
    and the next reuses it; stop_runtime() finalises it and a later communicator starts it again."""
    from ep_comm.memory import nvshmem_heap

    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    cfg = cases.make_cfg(world, "nvshmem", "standard", None)
    inputs = oracle.random_inputs(cfg, world, 3)
    problems: list[str] = []
    states = []
    a = ep_comm.Communicator(cfg, device=device)
    b = ep_comm.Communicator(cases.make_cfg(world, "nvshmem", "batched", "fp8"), device=device)
    states.append(nvshmem_heap.runtime_summary())
    for comm in (a, b, a):
        mine = inputs[rank].to(comm.device)
        d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
        y = comm.combine(oracle.run_experts(comm.cfg, rank, world, d), d)
        problems += oracle.compare_combine(comm.cfg, y, oracle.expected_combine_rank(comm.cfg, inputs, rank))
    a.close()
    b.close()
    states.append(nvshmem_heap.runtime_summary())
    stops = []
    for _ in range(2):  # the idle NVSHMEM reused, then NVSHMEM started again after stop_runtime()
        with ep_comm.Communicator(cfg, device=device) as c:
            states.append(nvshmem_heap.runtime_summary())
            mine = inputs[rank].to(c.device)
            d = c.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
            y = c.combine(oracle.run_experts(cfg, rank, world, d), d)
            problems += oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))
        stops.append(nvshmem_heap.stop_runtime())
        states.append(nvshmem_heap.runtime_summary())
    return {"problems": problems, "states": states, "stops": stops}


def test_nvshmem_is_shared_by_open_communicators_and_reused_after_the_last_close():
    for res in _spawn(lifecycle_worker, timeout_s=240):
        assert res["problems"] == [], res
        opened, closed, reused, stopped, restarted, stopped_again = res["states"]
        assert "started by ep_comm, 2 buffer(s)" in opened, res
        assert "started by ep_comm, idle, 0 buffer(s)" in closed, res
        assert "started by ep_comm, 1 buffer(s)" in reused, res
        assert "not started, 0 buffer(s)" in stopped, res
        assert "started by ep_comm, 1 buffer(s)" in restarted, res
        assert "not started, 0 buffer(s)" in stopped_again, res
        assert res["stops"] == [True, True], res


def torch_started_worker() -> dict:
    """NVSHMEM started by torch symmetric memory first: ep_comm joins it and leaves it running."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from ep_comm.memory import nvshmem_heap

    topo, device = cases.init_rank()
    world, rank = topo.world_size, topo.rank
    dev = torch.device("cuda", torch.cuda.current_device())
    symm_mem.set_backend("NVSHMEM")
    t = symm_mem.empty(4096, dtype=torch.uint8, device=dev)
    symm_mem.rendezvous(t, dist.group.WORLD)
    cfg = cases.make_cfg(world, "nvshmem", "batched", None)
    inputs = oracle.random_inputs(cfg, world, 9)
    with ep_comm.Communicator(cfg, device=device) as comm:
        state = nvshmem_heap.runtime_summary()
        mine = inputs[rank].to(comm.device)
        d = comm.dispatch(mine.x, mine.topk_ids, mine.topk_weights)
        y = comm.combine(oracle.run_experts(cfg, rank, world, d), d)
        problems = oracle.compare_combine(cfg, y, oracle.expected_combine_rank(cfg, inputs, rank))
    t2 = symm_mem.empty(4096, dtype=torch.uint8, device=dev)  # torch's NVSHMEM still works
    symm_mem.rendezvous(t2, dist.group.WORLD)
    t2.fill_(rank + 1)
    torch.cuda.synchronize()
    return {"problems": problems, "state": state, "after": int(t2[0].item())}


def test_nvshmem_started_by_torch_symmetric_memory_is_joined_and_left_running():
    for rank, res in enumerate(_spawn(torch_started_worker, timeout_s=240)):
        assert res["problems"] == [], res
        assert "started elsewhere, attached, 1 buffer(s)" in res["state"], res
        assert res["after"] == rank + 1, res


def choice_worker(fake_hosts: bool) -> dict:
    if fake_hosts:
        os.environ["EP_COMM_HOST_ID"] = f"fakehost{os.environ['RANK']}"
    topo, device = cases.init_rank()
    world = topo.world_size
    res = {}
    with ep_comm.Communicator(cases.make_cfg(world, "auto", "standard", None), device=device) as comm:
        res["auto"] = comm.backend
        res["auto_put"] = bool(getattr(comm._impl, "layout", None) and comm._impl.layout.put_mode)
    with ep_comm.Communicator(cases.make_cfg(world, "nvshmem", "standard", None), device=device) as comm:
        res["nvshmem_put"] = comm._impl.layout.put_mode
    return res


def test_backend_choice():
    # one host: auto prefers mnnvl; nvshmem on request reaches peers by stores
    for r in _spawn(choice_worker, False, timeout_s=180):
        assert r == {"auto": "mnnvl", "auto_put": False, "nvshmem_put": False}, r
    # ranks posing as two hosts without an IMEX channel: mnnvl cannot map peers, nvshmem takes over in
    # put mode (NVSHMEM_REMOTE_TRANSPORT=none here still lets NVSHMEM move the puts over NVLink)
    for r in _spawn(choice_worker, True, timeout_s=180):
        assert r == {"auto": "nvshmem", "auto_put": True, "nvshmem_put": True}, r


@pytest.mark.parametrize("case", ["ops_fullgraph", "communicator"])
def test_torch_compile(case):
    """The nvshmem ops compile whole (fullgraph) through their fakes, and the public API inside a compiled
    function matches the oracle."""
    _assert_clean(case, "compile", compile_worker, "nvshmem")


def test_bad_input_on_any_rank_is_raised_everywhere_and_the_next_call_works():
    for rank, problems in enumerate(_spawn(bad_input_recovery_worker, "nvshmem", "batched", timeout_s=240)):
        assert problems == [], f"rank {rank}: {problems}"


def test_close_and_create_again_after_a_timeout():
    """NVSHMEM too: after a timeout with every process alive, the ranks meet at close and free the heap
    collectively, so a new communicator starts in the same processes; memory and fds stay flat."""
    results = _spawn(recreate_after_timeout_worker, "nvshmem", RECREATE_CYCLES, timeout_s=560)
    check_recreated(results, RECREATE_CYCLES)


def test_a_refused_dispatch_with_validation_off_is_raised_everywhere_and_the_next_call_works():
    for rank, problems in enumerate(_spawn(validation_off_recovery_worker, "nvshmem", "batched", timeout_s=240)):
        assert problems == [], f"rank {rank}: {problems}"
