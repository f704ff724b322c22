"""run_or_spawn: the main() of a script that runs under a launcher or spawns its own ranks."""
from __future__ import annotations

import os

from ep_comm.distributed import spawn


def _rank_and_world(tag: str) -> tuple[str, int, int]:
    return tag, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _fails(tag: str) -> None:
    if os.environ["RANK"] == "1":
        raise ValueError(f"{tag}: rank 1 fails")


def _alone(monkeypatch) -> None:
    """No launcher's world in the environment (as on a laptop)."""
    for var in ("WORLD_SIZE", "RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
                "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


def test_alone_it_spawns_ranks_and_returns_their_results(monkeypatch) -> None:
    _alone(monkeypatch)
    results = spawn.run_or_spawn(_rank_and_world, ("x",), nproc=3, timeout_s=120)
    assert results is not None and [r.value for r in results] == [("x", r, 3) for r in range(3)]


def test_a_failed_rank_is_reported_on_stderr(monkeypatch, capfd) -> None:
    _alone(monkeypatch)
    results = spawn.run_or_spawn(_fails, ("y",), nproc=2, timeout_s=120)
    assert results is not None and [r.ok for r in results] == [True, False]
    assert "rank 1 failed: ValueError: y: rank 1 fails" in capfd.readouterr().err


def test_under_a_launcher_this_process_is_one_rank(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    called = []
    launched = lambda t: called.append(("launched", t))  # noqa: E731
    assert spawn.run_or_spawn(lambda t: called.append(("fn", t)), ("z",), launched=launched) is None
    assert called == [("launched", "z")]
    assert spawn.run_or_spawn(lambda t: called.append(("fn", t)), ("z",)) is None
    assert called[-1] == ("fn", "z")


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def test_spawned_ranks_share_the_cores_between_their_thread_pools(monkeypatch) -> None:
    # at torch's default every rank would start a thread per core: N ranks oversubscribe the host
    _alone(monkeypatch)
    results = spawn.spawn_local(_threads, 2, timeout_s=120)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.value for r in results] == [max(1, spawn._usable_cpus() // 2)] * 2
