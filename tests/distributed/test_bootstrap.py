"""init_distributed in spawned ranks: gloo without CUDA, Topology, EP_COMM_HOST_ID."""
import os

import pytest
import torch

import ep_comm
from ep_comm.distributed.spawn import raise_on_failure, spawn_local


def topo_worker():
    import torch.distributed as dist

    topo = ep_comm.init_distributed(timeout_s=30)
    again = ep_comm.init_distributed()  # no-op when already initialised
    return dict(topo=topo, again=again, backend=dist.get_backend())


def test_single_host():
    res = raise_on_failure(spawn_local(topo_worker, 3, timeout_s=60, extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": ""}))
    for rank, r in enumerate(res):
        t = r["topo"]
        assert r["backend"] == "gloo"
        assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.node_rank) == (rank, 3, rank, 3, 0)
        assert list(t.ranks_by_host.values()) == [(0, 1, 2)]
        assert r["again"] == t


def test_host_id_override_makes_fake_hosts():
    hosts = {0: "hostA", 1: "hostB", 2: "hostA", 3: "hostB"}
    res = raise_on_failure(spawn_local(topo_worker, 4, timeout_s=60,
                                       extra_env=lambda r: {"CUDA_VISIBLE_DEVICES": "", "EP_COMM_HOST_ID": hosts[r]}))
    for rank, r in enumerate(res):
        t = r["topo"]
        assert t.host_id == hosts[rank]
        assert dict(t.ranks_by_host) == {"hostA": (0, 2), "hostB": (1, 3)}
        assert t.local_world_size == 2 and t.local_rank == rank // 2
        assert t.node_rank == (0 if hosts[rank] == "hostA" else 1)
        assert t.same_host(0, 2) and not t.same_host(0, 1)


def ompi_worker():
    topo = ep_comm.init_distributed(timeout_s=30)
    return (topo.rank, topo.world_size, os.environ["RANK"])


def test_openmpi_variables_with_master_addr():
    # spawn_local sets torchrun variables; replace them with Open MPI ones for this test
    def env(rank):
        return {"CUDA_VISIBLE_DEVICES": "", "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "RANK": "", "WORLD_SIZE": ""}

    res = raise_on_failure(spawn_local(_without_torchrun_vars, 2, (ompi_worker,), timeout_s=60, extra_env=env))
    assert res == [(0, 2, "0"), (1, 2, "1")]


def _without_torchrun_vars(fn):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if os.environ.get(var) == "":
            del os.environ[var]
    return fn()


def backend_worker(backend):
    import torch.distributed as dist

    topo = ep_comm.init_distributed(timeout_s=30, backend=backend)
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    return dict(backend=dist.get_backend(), device=device, topo_device=topo.device_index)


def test_a_gloo_job_on_gpus_still_spreads_the_ranks_over_them():
    """``backend="gloo"`` makes a gloo job on any machine; with GPUs every rank still takes GPU
    ``local_rank % count`` (more ranks than GPUs share them), without them the job is the usual CPU one."""
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = max(2, 2 * ngpu)
    res = raise_on_failure(spawn_local(backend_worker, world, ("gloo",), timeout_s=60))
    for rank, r in enumerate(res):
        assert r["backend"] == "gloo"
        expected = rank % ngpu if ngpu else None
        assert (r["device"], r["topo_device"]) == (expected, expected)


def test_an_unknown_or_impossible_backend_is_refused():
    with pytest.raises(ep_comm.EPConfigError, match="init_distributed backend='mpi': must be None, 'nccl' or 'gloo'"):
        ep_comm.init_distributed(backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ep_comm.EPTopologyError, match="needs CUDA"):
            ep_comm.init_distributed(backend="nccl")
