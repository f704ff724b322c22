import sys
import types

import pytest

from ep_comm import EPConfigError
from ep_comm.distributed import bootstrap
from ep_comm.distributed.launch_env import expand_slurm_nodelist, read_launch_env, slurm_default_rendezvous


def test_torchrun():
    info = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                            "MASTER_PORT": "29500"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("torchrun", 3, 8, 1)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", 29500)


def test_openmpi():
    info = read_launch_env({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "16",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "5"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.is_mpi) == ("openmpi", 5, 16, 5, True)


def test_mpich_pmi():
    info = read_launch_env({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"})
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.is_mpi) == ("pmi", 2, 4, 0, True)


def test_slurm():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_JOB_ID": "12345"}
    info = read_launch_env(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("slurm", 9, 16, 1)
    addr, port = slurm_default_rendezvous(env)
    assert addr == "gpu07" and 20000 <= port < 40000
    assert bootstrap.resolve_rendezvous(info, env) == (addr, port)


def test_precedence_innermost_launcher_wins():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert read_launch_env(env).launcher == "torchrun"


def test_nothing_set_is_single_process():
    info = read_launch_env({})
    assert (info.launcher, info.rank, info.world_size) == ("none", 0, 1)
    addr, port = bootstrap.resolve_rendezvous(info, {})
    assert addr == "127.0.0.1" and port > 0


def test_bad_values():
    with pytest.raises(EPConfigError, match="RANK"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(EPConfigError, match="must be in"):
        read_launch_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_torchrun_without_master_addr_is_config_error():
    info = read_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(EPConfigError, match="MASTER_ADDR"):
        bootstrap.resolve_rendezvous(info, {})


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[007-009,12],login5", ["gpu007", "gpu008", "gpu009", "gpu12", "login5"]),
    ("a[1,3]b,c", ["a1b", "a3b", "c"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


def test_mpi_without_master_addr_broadcasts_rank0_address(monkeypatch):
    calls = []

    class FakeComm:
        def Get_rank(self):
            return 0

        def bcast(self, obj, root):
            calls.append((obj, root))
            return obj

    fake = types.ModuleType("mpi4py")
    fake.MPI = types.SimpleNamespace(COMM_WORLD=FakeComm())
    monkeypatch.setitem(sys.modules, "mpi4py", fake)
    info = read_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"})
    addr, port = bootstrap.resolve_rendezvous(info, {})
    assert calls and calls[0][1] == 0 and calls[0][0] == (addr, port)
    assert port > 0


def test_mpi_without_mpi4py_says_how_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    info = read_launch_env({"PMI_RANK": "0", "PMI_SIZE": "2"})
    with pytest.raises(EPConfigError, match="mpi4py"):
        bootstrap.resolve_rendezvous(info, {})
