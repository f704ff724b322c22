"""naive and ag_rs on gloo (CPU) with 2, 4 and 8 spawned ranks, against the oracle."""
import pytest

from ep_comm.distributed.spawn import raise_on_failure, spawn_local

from .. import cases

WORLDS = (2, 4, 8)
_cache: dict = {}


def matrix(world: int) -> dict:
    if world not in _cache:
        per_rank = raise_on_failure(spawn_local(cases.backend_matrix, world, timeout_s=600,
                                                extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
        merged: dict = {}
        for rank, res in enumerate(per_rank):
            for key, problems in res.items():
                merged.setdefault(key, []).extend(f"rank {rank}: {p}" for p in problems)
        _cache[world] = merged
    return _cache[world]


ALL_CASES = [f"{b}/{layout}/{p}/{s}" for b in ("naive", "ag_rs") for layout in ("standard", "batched")
             for p in cases.PAYLOADS for s in cases.scenarios(2, 16)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ALL_CASES)
def test_matches_oracle(world, case):
    results = matrix(world)
    assert case in results, f"case {case} did not run (ran: {sorted(results)[:4]}...)"
    assert results[case] == [], "\n".join(results[case])


@pytest.mark.parametrize("backend", ["naive", "ag_rs"])
def test_device_epoch_headers_on_cpu(backend):
    """The CUDA-graph safety net (headers checked on the device), exercised with gloo."""
    per_rank = raise_on_failure(spawn_local(cases.device_headers, 2, (backend,), timeout_s=120,
                                            extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
    for rank, res in enumerate(per_rank):
        assert set(res) == {"standard/clean", "standard/mismatch", "batched/clean", "batched/mismatch"}
        for key, problems in res.items():
            assert problems == [], f"rank {rank} {key}: {problems}"


@pytest.mark.parametrize("backend", ["naive", "ag_rs"])
def test_unchecked_ids_are_dropped_and_raised_by_a_later_call(backend):
    """validate_ids=False: no host check of the ids; out-of-range ids travel as -1 and are reported later."""
    per_rank = raise_on_failure(spawn_local(cases.unchecked_ids, 3, (backend,), timeout_s=180,
                                            extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
    for rank, res in enumerate(per_rank):
        assert set(res) == {f"{backend}/standard", f"{backend}/batched"}
        for key, problems in res.items():
            assert problems == [], f"rank {rank} {key}: " + "\n".join(problems)
