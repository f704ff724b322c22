"""Exchange over torch.distributed (gloo, spawned ranks), mpi4py, and one process."""
from __future__ import annotations

import random
import sys

import pytest

from ep_comm.distributed.exchange import Exchange, LocalExchange, MPIExchange, TorchExchange, exchange_from
from ep_comm.distributed.spawn import raise_on_failure, spawn_local
from ep_comm.errors import EPConfigError


def _payload(seed: int, rank: int, round_: int) -> bytes:
    rng = random.Random(seed * 7919 + rank * 131 + round_)
    # lengths differ per rank and include 0, so the padding path is exercised
    return rng.randbytes(rng.choice([0, 1, 17, 300, 4099]))


def _gloo_worker(seed: int) -> dict:
    import torch.distributed as dist

    from ep_comm.distributed import init_distributed

    init_distributed()
    ex = TorchExchange()
    rounds = [ex.allgather_bytes(_payload(seed, ex.rank, i)) for i in range(3)]
    ex.barrier()
    empties = ex.allgather_bytes(b"")
    same = isinstance(exchange_from(None), TorchExchange) and exchange_from(dist.group.WORLD).size == ex.size
    return {"rank": ex.rank, "size": ex.size, "rounds": rounds, "empties": empties, "from": same}


def _check_rounds(values: list[dict], seed: int, nproc: int) -> None:
    for v in values:
        assert v["size"] == nproc
        assert v["from"]
        assert v["empties"] == [b""] * nproc
        for i, got in enumerate(v["rounds"]):
            assert got == [_payload(seed, r, i) for r in range(nproc)]
    assert [v["rank"] for v in values] == list(range(nproc))


@pytest.mark.parametrize("nproc", [2, 4])
def test_torch_exchange_gloo(nproc: int) -> None:
    seed = random.randrange(1 << 30)
    values = raise_on_failure(spawn_local(_gloo_worker, nproc, args=(seed,), timeout_s=120))
    _check_rounds(values, seed, nproc)


def _shadow_gloo_worker(seed: int) -> dict:
    """Pretend the default group cannot carry CPU tensors (as with plain NCCL) so that TorchExchange
    builds and caches its own gloo groups, for the world and for a subgroup."""
    import torch.distributed as dist

    from ep_comm.distributed import exchange as exmod
    from ep_comm.distributed import init_distributed

    init_distributed()
    real = exmod._supports_cpu_tensors
    exmod._supports_cpu_tensors = lambda d, g: False
    try:
        ex = TorchExchange()
        again = TorchExchange()
        cached = ex._cpu_group is again._cpu_group and ex._cpu_group is not dist.group.WORLD
        rank = dist.get_rank()
        odd = dist.new_group([1, 3])  # collective over the world, as torch requires
        sub = None
        if rank in (1, 3):
            sub_ex = TorchExchange(odd)
            sub = sub_ex.allgather_bytes(_payload(seed, 100 + rank, 0))
        rounds = [ex.allgather_bytes(_payload(seed, ex.rank, i)) for i in range(3)]
        ex.barrier()
    finally:
        exmod._supports_cpu_tensors = real
    return {"rank": ex.rank, "size": ex.size, "rounds": rounds, "empties": [b""] * ex.size,
            "from": True, "cached": cached, "sub": sub}


def test_torch_exchange_builds_gloo_group_when_default_cannot_carry_bytes() -> None:
    seed = random.randrange(1 << 30)
    values = raise_on_failure(spawn_local(_shadow_gloo_worker, 4, args=(seed,), timeout_s=120))
    _check_rounds(values, seed, 4)
    assert all(v["cached"] for v in values)
    expected_sub = [_payload(seed, 101, 0), _payload(seed, 103, 0)]
    assert [v["sub"] for v in values] == [None, expected_sub, None, expected_sub]


def test_torch_exchange_needs_initialised_torch_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - only when another test leaked a group
        pytest.skip("torch.distributed already initialised in this process")
    with pytest.raises(EPConfigError, match="init_distributed"):
        TorchExchange()


def test_local_exchange_and_exchange_from(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    ex = exchange_from(None)
    assert isinstance(ex, LocalExchange) and isinstance(ex, Exchange)
    data = random.randbytes(33)
    assert ex.allgather_bytes(data) == [data]
    ex.barrier()
    assert exchange_from(ex) is ex
    with pytest.raises(EPConfigError, match="ProcessGroup"):
        exchange_from(object())
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(EPConfigError, match="WORLD_SIZE=2"):
        exchange_from(None)


def test_mpi_exchange_without_mpi4py_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `from mpi4py import MPI` raise ImportError
    with pytest.raises(EPConfigError, match="mpi4py"):
        MPIExchange()


def test_mpi_exchange_single_process() -> None:
    try:
        from mpi4py import MPI
    except ImportError:
        pytest.skip("mpi4py is not installed")
    for comm in (MPI.COMM_SELF, MPI.COMM_WORLD):
        ex = exchange_from(comm)
        assert isinstance(ex, MPIExchange)
        assert (ex.rank, ex.size) == (comm.Get_rank(), comm.Get_size())
        data = random.randbytes(random.randrange(1, 200))
        got = ex.allgather_bytes(data)
        assert len(got) == ex.size and got[ex.rank] == data
        ex.barrier()


def _mpi_main(seed: int) -> None:
    """Entry point of each rank under mpiexec (see the test below)."""
    from mpi4py import MPI

    ex = exchange_from(MPI.COMM_WORLD)
    got = ex.allgather_bytes(_payload(seed, ex.rank, 0))
    ex.barrier()
    if got != [_payload(seed, r, 0) for r in range(ex.size)]:
        raise SystemExit(f"rank {ex.rank}: allgather_bytes returned the wrong payloads")
    print(f"rank {ex.rank} of {ex.size} ok", flush=True)


def test_mpi_exchange_two_ranks_under_mpiexec() -> None:
    import os
    import shutil
    import subprocess

    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    seed = random.randrange(1 << 30)
    code = f"from tests.distributed.test_exchange import _mpi_main; _mpi_main({seed})"
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 of 2 ok" in proc.stdout and "rank 1 of 2 ok" in proc.stdout


def _control_plane_exchange_worker():
    from ep_comm.distributed import init_distributed
    from ep_comm.distributed.control import ControlPlane
    from ep_comm.distributed.exchange import Exchange

    topo = init_distributed()
    cp = ControlPlane(None, 30.0)
    try:
        is_exchange = isinstance(cp, Exchange)
        got = cp.allgather_bytes(bytes([topo.rank]) * (3 * topo.rank))  # rank 0 sends b""
        cp.barrier()
        objs = cp.gather_objects({"rank": topo.rank})
        return is_exchange, got, objs
    finally:
        cp.close()


def test_control_plane_is_an_exchange():
    res = raise_on_failure(spawn_local(_control_plane_exchange_worker, 3, timeout_s=120,
                                       extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
    for is_exchange, got, objs in res:
        assert is_exchange
        assert got == [b"", b"\x01" * 3, b"\x02" * 6]
        assert objs == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
