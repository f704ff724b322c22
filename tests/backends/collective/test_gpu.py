"""naive and ag_rs on NCCL, one rank per GPU: the CPU matrix, CUDA-graph capture, device checks."""
import pytest
import torch

import ep_comm
from ep_comm import oracle
from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .. import cases

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]


def _world() -> int:
    return torch.cuda.device_count()


_cache: dict = {}


def _run(name, fn):
    if name not in _cache:
        _cache[name] = cases.merge_ranks(raise_on_failure(spawn_local(fn, _world(), timeout_s=900)))
    return _cache[name]


MATRIX_CASES = [f"{b}/{layout}/{p}/{s}" for b in ("naive", "ag_rs") for layout in ("standard", "batched")
                for p in cases.PAYLOADS for s in cases.scenarios(2, 16)]


@pytest.mark.parametrize("case", MATRIX_CASES)
def test_nccl_matches_oracle(case):
    results = _run("matrix", cases.backend_matrix)
    assert case in results
    assert results[case] == [], "\n".join(results[case])


GRAPH_CASES = [f"{b}/{layout}/{q}" for b in ("naive", "ag_rs") for layout in ("standard", "batched")
               for q in ("bf16", "fp8")]


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_cuda_graph_capture_and_replay(case):
    results = _run("graph", cases.graph_capture)
    assert case in results
    assert results[case] == [], "\n".join(results[case])


def device_check_worker():
    topo = ep_comm.init_distributed()
    cfg = cases.make_cfg(topo.world_size, "ag_rs", "standard", None)
    with ep_comm.Communicator(cfg) as comm:
        good = oracle.random_inputs(cfg, topo.world_size, 3)[topo.rank].to(comm.device)
        x = good.x.cpu() if topo.rank == 0 else good.x  # rank 0 passes a host tensor
        try:
            comm.dispatch(x, good.topk_ids, good.topk_weights)
            return "no error"
        except ep_comm.EPInputError as exc:
            return str(exc)


def test_host_tensor_is_rejected_on_every_rank():
    msgs = raise_on_failure(spawn_local(device_check_worker, _world(), timeout_s=120))
    assert "x is on cpu" in msgs[0]
    for m in msgs[1:]:
        assert "rank(s) [0]" in m


@pytest.mark.parametrize("backend", ["naive", "ag_rs"])
def test_unchecked_ids_need_no_host_sync(backend):
    """validate_ids=False on NCCL: eager dispatch and combine never synchronise the host; out-of-range ids
    travel as -1 and a later dispatch raises on every rank."""
    results = cases.merge_ranks(raise_on_failure(spawn_local(cases.unchecked_ids, _world(), (backend,),
                                                             timeout_s=300)))
    assert set(results) == {f"{backend}/standard", f"{backend}/batched"}
    for key, problems in results.items():
        assert problems == [], f"{key}: " + "\n".join(problems)
