"""Handle plan (pure Python) and the collective refusal of SymmetricBuffer.create, on CPU."""
from __future__ import annotations

import random
import time
from typing import Optional

import pytest

from ep_comm.distributed.spawn import raise_on_failure, spawn_local
from ep_comm.distributed.topology import Topology, local_host_id
from ep_comm.errors import EPTopologyError
from ep_comm.memory.plan import HandleType, plan_handles
from ep_comm.memory.probe import Capabilities

GRAN = 2 << 20


def gpu_caps(i: int, fabric: bool = False, combined: bool = False, fd: bool = True,
             blocked: tuple[int, ...] = (), fabric_gran: int = GRAN) -> Capabilities:
    """Capabilities as the probe reports them on an H200 (fabric attribute 1, permitted or not)."""
    return Capabilities(
        cuda=True, device_index=i % 8, device_name="NVIDIA H200", pci_bus_id=f"0000:{i:02x}:00.0",
        driver_version=13000, vmm_supported=True, posix_fd_supported=True, posix_fd_permitted=fd,
        posix_fd_error="" if fd else "CUDA_ERROR_NOT_SUPPORTED",
        fabric_supported=True, fabric_permitted=fabric,
        fabric_error="" if fabric else "CUDA_ERROR_NOT_PERMITTED", combined_handle_types=combined,
        granularity=GRAN, fabric_granularity=fabric_gran if fabric else 0,
        peer_access=tuple((f"0000:{j:02x}:00.0", j not in blocked) for j in range(16) if j != i),
    )


def topo_from_env(rank: int, envs: list[dict]) -> Topology:
    """Topology as every rank would build it from its peers' EP_COMM_HOST_ID."""
    return Topology.from_host_ids(rank, [local_host_id(e) for e in envs])


def plans(envs: list[dict], caps: list[Capabilities], **kw):
    return [plan_handles(topo_from_env(r, envs), caps, **kw) for r in range(len(envs))]


def test_one_host_uses_posix_fds() -> None:
    envs = [{"EP_COMM_HOST_ID": "h0"}] * 4
    ps = plans(envs, [gpu_caps(i) for i in range(4)])
    for r, p in enumerate(ps):
        assert p.peer_handle == tuple(HandleType.NONE if q == r else HandleType.POSIX_FD for q in range(4))
        assert p.alloc_handles == (HandleType.POSIX_FD,)
        assert p.granularity == GRAN
    assert len({(p.alloc_handles, p.granularity, p.hosts) for p in ps}) == 1


def test_single_rank_exports_nothing() -> None:
    (p,) = plans([{"EP_COMM_HOST_ID": "solo"}], [gpu_caps(0, fd=False)])
    assert p.peer_handle == (HandleType.NONE,) and p.alloc_handles == ()


@pytest.mark.parametrize("combined", [True, False])
def test_two_hosts_with_fabric(combined: bool) -> None:
    envs = [{"EP_COMM_HOST_ID": "a"}, {"EP_COMM_HOST_ID": "a"}, {"EP_COMM_HOST_ID": "b"}, {"EP_COMM_HOST_ID": "b"}]
    caps = [gpu_caps(i, fabric=True, combined=combined, fabric_gran=4 * GRAN) for i in range(4)]
    ps = plans(envs, caps)
    inside = HandleType.POSIX_FD if combined else HandleType.FABRIC
    for r, p in enumerate(ps):
        for q in range(4):
            want = HandleType.NONE if q == r else inside if (q < 2) == (r < 2) else HandleType.FABRIC
            assert p.peer_handle[q] == want, (r, q)
            assert p.peer_handle[q] == ps[q].peer_handle[r]  # both sides of a pair agree
        assert p.granularity == 4 * GRAN  # the larger of the two handle types' granularities
    assert {p.alloc_handles for p in ps} == {
        (HandleType.POSIX_FD, HandleType.FABRIC) if combined else (HandleType.FABRIC,)
    }


def _refusals(envs: list[dict], caps: list[Capabilities], **kw) -> list[str]:
    msgs = []
    for r in range(len(envs)):
        with pytest.raises(EPTopologyError) as info:
            plan_handles(topo_from_env(r, envs), caps, **kw)
        msgs.append(str(info.value))
    return msgs


def test_two_hosts_without_fabric_refused_on_every_rank_with_the_same_message() -> None:
    envs = [{"EP_COMM_HOST_ID": "node-a"}] * 2 + [{"EP_COMM_HOST_ID": "node-b"}] * 2
    msgs = _refusals(envs, [gpu_caps(i) for i in range(4)])
    assert len(set(msgs)) == 1
    msg = msgs[0]
    for part in ("host 'node-a': rank(s) 0-1", "host 'node-b': rank(s) 2-3", "FABRIC handles were not permitted",
                 "CUDA_ERROR_NOT_PERMITTED", "/dev/nvidia-caps-imex-channels", "nvidia-imex", "ag_rs", "naive",
                 "fabric attribute=1"):
        assert part in msg, part
    assert "nvshmem" not in msg


def test_refusal_names_offered_backends_and_is_global_when_one_rank_lacks_fabric() -> None:
    # hosts a:{0,1} b:{2,3} c:{4}; only rank 4 lacks fabric, yet ranks 0-3 must refuse too
    hosts = ["a", "a", "b", "b", "c"]
    envs = [{"EP_COMM_HOST_ID": h} for h in hosts]
    caps = [gpu_caps(i, fabric=i != 4) for i in range(5)]
    msgs = _refusals(envs, caps, usable_backends=("ag_rs", "naive", "nvshmem"))
    assert len(set(msgs)) == 1
    assert "not permitted on ranks 4" in msgs[0] and "nvshmem" in msgs[0]


def test_no_cuda_rank_refused() -> None:
    envs = [{"EP_COMM_HOST_ID": "h"}] * 2
    caps = [gpu_caps(0), Capabilities(cuda=False, reason="cuda-bindings (cuda-python) not installed")]
    msgs = _refusals(envs, caps)
    assert len(set(msgs)) == 1 and "rank(s) 1" in msgs[0] and "no CUDA" in msgs[0]


def test_same_host_without_peer_access_refused() -> None:
    envs = [{"EP_COMM_HOST_ID": "h"}] * 3
    caps = [gpu_caps(0), gpu_caps(1), gpu_caps(2, blocked=(0,))]
    msgs = _refusals(envs, caps)
    assert len(set(msgs)) == 1 and "cuDeviceCanAccessPeer=0" in msgs[0]


def test_same_host_without_posix_fd_refused() -> None:
    envs = [{"EP_COMM_HOST_ID": "h"}] * 2
    msgs = _refusals(envs, [gpu_caps(0), gpu_caps(1, fd=False)])
    assert "POSIX_FILE_DESCRIPTOR" in msgs[0] and "CUDA_ERROR_NOT_SUPPORTED" in msgs[0]


def test_capabilities_round_trip() -> None:
    c = gpu_caps(random.randrange(8), fabric=random.random() < 0.5)
    assert Capabilities.from_bytes(c.to_bytes()) == c
    assert Capabilities.from_dict(c.to_dict()) == c
    assert "not permitted" in gpu_caps(0).fabric_summary()


# ---- SymmetricBuffer.create decides collectively, before any allocation (runs on CPU) ----------

def _fake_probe(device_index: Optional[int] = None) -> Capabilities:
    import os

    return gpu_caps(int(os.environ["RANK"]))


def _create_worker(nbytes: int) -> dict:
    from ep_comm.distributed import init_distributed
    from ep_comm.errors import EPConfigError, EPError
    from ep_comm.memory import symmetric

    topo = init_distributed()
    out = {}

    def attempt(name: str, size: int) -> None:
        t0 = time.monotonic()
        try:
            symmetric.SymmetricBuffer.create(size, None, topo)
            out[name] = ("created", "", 0.0)
        except EPError as exc:
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - t0)

    attempt("real_probe", nbytes)  # this machine has no CUDA: refused everywhere
    symmetric.probe_capabilities = _fake_probe  # H200s without an IMEX channel
    attempt("fake_gpu", nbytes)
    attempt("size_mismatch", nbytes + topo.rank)
    attempt("bad_nbytes", nbytes if topo.rank == 0 else 0)  # one rank's bad argument fails them all
    out["config_error_is_value_error"] = issubclass(EPConfigError, ValueError)
    return out


def test_create_refuses_on_every_rank_before_allocating() -> None:
    nbytes = random.randrange(1, 1 << 20)
    results = spawn_local(_create_worker, 2, args=(nbytes,), timeout_s=120,
                          extra_env=lambda r: {"EP_COMM_HOST_ID": f"fake-host-{r}"})
    values = raise_on_failure(results)
    for name in ("real_probe", "fake_gpu", "size_mismatch", "bad_nbytes"):
        assert len({v[name][1] for v in values}) == 1, name  # same message on every rank
    for v in values:
        kind, msg, elapsed = v["real_probe"]
        assert kind == "EPTopologyError" and "no CUDA" in msg and elapsed < 10
        kind, msg, elapsed = v["fake_gpu"]
        assert kind == "EPTopologyError" and elapsed < 10
        assert "/dev/nvidia-caps-imex-channels" in msg and "CUDA_ERROR_NOT_PERMITTED" in msg
        assert "host 'fake-host-0': rank(s) 0" in msg and "host 'fake-host-1': rank(s) 1" in msg
        kind, msg, _ = v["size_mismatch"]
        assert kind == "EPConfigError" and "different sizes" in msg
        kind, msg, _ = v["bad_nbytes"]
        assert kind == "EPConfigError" and "rank 1: nbytes=0 must be a positive integer" in msg
