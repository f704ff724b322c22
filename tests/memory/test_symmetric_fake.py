"""SymmetricBuffer's whole create/map/use/close path on CPU, over a host-memory fake of the driver.

The fake (tests/memory/fake_cuda.py) maps real shared memory, so a write through ``peer(r)`` in one
process is read back from ``local`` in process r, exactly as the GPU test does over NVLink.
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

from ep_comm.distributed.exchange import LocalExchange
from ep_comm.distributed.spawn import raise_on_failure, spawn_local
from ep_comm.errors import EPConfigError, EPError
from ep_comm.memory import HandleType, SymmetricBuffer, probe_capabilities
from ep_comm.memory._dlpack import live_views

from . import fake_cuda

GRAN = fake_cuda.GRANULARITY


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    from ep_comm.memory import _driver, symmetric

    monkeypatch.setattr(_driver, "_DRIVER", None)
    monkeypatch.setattr(symmetric, "_TENSOR_DEVICE_TYPE", "cuda")
    f = fake_cuda.install()
    yield f
    from ep_comm.memory import probe as probe_mod

    probe_mod._probe_cached.cache_clear()


def _unix_socket_inodes() -> set[str]:
    with open("/proc/net/unix") as f:
        next(f)  # header
        return {line.split()[6] for line in f if len(line.split()) > 6}


def _own_fds() -> set[tuple[int, str]]:
    """(fd, target) of every descriptor the memory layer or the fake driver can open in this process:
    memfds (allocations and their POSIX exports), pidfds (FABRIC imports) and AF_UNIX sockets (fd
    passing).

    TCP sockets and pipes are left out on purpose: they belong to torch.distributed and
    multiprocessing, and gloo closes its end of a connection as soon as a faster peer process exits.
    Counting the whole fd table therefore flaked (``fd_leak == -1``) whenever a peer finished first.
    """
    unix = _unix_socket_inodes()
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the directory's own fd, closed again by listdir
            continue
        if target.startswith("/memfd:") or target == "anon_inode:[pidfd]" or (
                target.startswith("socket:[") and target[8:-1] in unix):
            out.add((int(name), target))
    return out


def _fd_leak(before: set[tuple[int, str]]) -> list[str]:
    """Descriptors of the kinds above opened since ``before`` and still open (a readable list)."""
    return sorted(f"{fd} -> {target}" for fd, target in _own_fds() - before)


def test_probe_against_fake_driver(fake) -> None:
    caps = probe_capabilities(1)
    assert caps.cuda and caps.vmm_supported and caps.device_index == 1
    assert caps.posix_fd_permitted and caps.posix_fd_error == ""
    assert caps.fabric_supported and not caps.fabric_permitted
    assert caps.fabric_error == "CUDA_ERROR_NOT_PERMITTED"
    assert "fabric supported but not permitted" in caps.fabric_summary()
    assert caps.granularity == GRAN and caps.peer_access == (("0000:18:00.0", True),)
    assert fake.live() == {"handles": 0, "reservations": 0, "mappings": 0, "ctx_refs": 0, "ctx_stack": 0}


def test_single_rank_buffer(fake) -> None:
    fds = _own_fds()
    nbytes = GRAN + random.randrange(1, 1000)
    with SymmetricBuffer.create(nbytes, LocalExchange(), device_index=0) as buf:
        assert buf.nbytes == nbytes and buf.stride == 2 * GRAN and buf.world_size == 1
        assert buf.plan.alloc_handles == () and buf.plan.peer_handle == (HandleType.NONE,)
        assert buf.local.dtype == torch.uint8 and buf.local.shape == (nbytes,)
        assert buf.ptr(0) % GRAN == 0 and buf.peer_ptrs.tolist() == [buf.ptr(0)]
        assert buf.peer_ptrs.dtype == torch.int64
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        buf.local.copy_(data)
        assert torch.equal(buf.peer(0), data)
        with pytest.raises(EPConfigError):
            buf.peer(1)
    assert buf.closed
    buf.close()  # idempotent
    with pytest.raises(EPError, match="closed"):
        _ = buf.local
    assert fake.live() == {"handles": 0, "reservations": 0, "mappings": 0, "ctx_refs": 0, "ctx_stack": 0}
    assert _fd_leak(fds) == []


def test_dropping_buffer_frees_after_last_view(fake) -> None:
    buf = SymmetricBuffer.create(100, LocalExchange(), device_index=0)
    view = buf.local[10:20]
    del buf
    assert fake.live()["mappings"] == 1  # a tensor still views the memory: nothing unmapped yet
    view.fill_(7)
    del view
    assert fake.live() == {"handles": 0, "reservations": 0, "mappings": 0, "ctx_refs": 0, "ctx_stack": 0}
    assert live_views() == 0


def test_bad_nbytes_is_a_config_error(fake) -> None:
    for bad in (0, -5, 2.5, "12"):
        with pytest.raises(EPConfigError, match="nbytes"):
            SymmetricBuffer.create(bad, LocalExchange(), device_index=0)
    assert fake.live()["handles"] == 0


# ---- several processes -------------------------------------------------------------------------

def _rw_worker(seed: int, nbytes: int, cycles: int, fabric: bool) -> dict:
    from ep_comm.distributed import init_distributed
    from ep_comm.distributed.exchange import TorchExchange

    fake = fake_cuda.install(fabric=fabric)
    topo = init_distributed()
    ex = TorchExchange()
    rank, world = ex.rank, ex.size
    fds_before = _own_fds()
    gen = torch.Generator().manual_seed(seed)
    sent = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(world)]
    with SymmetricBuffer.create(nbytes, ex, topo, device_index=rank % 2, timeout_s=20) as buf:
        plan = [h.value for h in buf.plan.peer_handle]
        # every rank's own bytes, read back by every rank through its mapping of that rank
        buf.local.copy_(sent[(rank + 2) % world])
        ex.barrier()
        owners_ok = all(torch.equal(buf.peer(p).clone(), sent[(p + 2) % world]) for p in range(world))
        ex.barrier()
        dst = (rank + 1) % world
        buf.peer(dst).copy_(sent[rank])  # store into the next rank's memory
        ex.barrier()
        got_ok = torch.equal(buf.local.clone(), sent[(rank - 1) % world])
        read_ok = torch.equal(buf.peer(dst).clone(), sent[rank])  # read back through the mapping
        ptrs = buf.peer_ptrs.tolist()
        # our own slot holds the allocation this process created, every other slot an import
        origins_ok = [fake.origin_at(buf.ptr(p)) for p in range(world)] == [
            "created" if p == rank else "imported" for p in range(world)]
        stride = buf.stride
    live_after = fake.live()
    for i in range(cycles):
        b = SymmetricBuffer.create(nbytes, ex, topo, device_index=rank % 2, timeout_s=20)
        b.local.fill_(i % 251)
        b.close()
    ex.barrier()
    return {"plan": plan, "owners_ok": owners_ok, "origins_ok": origins_ok, "got_ok": got_ok, "read_ok": read_ok,
            "ptrs": ptrs, "stride": stride, "live_after": live_after, "live_end": fake.live(),
            "fd_leak": _fd_leak(fds_before)}


def _check_rw(values: list[dict], world: int) -> None:
    empty = {"handles": 0, "reservations": 0, "mappings": 0, "ctx_refs": 0, "ctx_stack": 0}
    for r, v in enumerate(values):
        assert v["origins_ok"] and v["owners_ok"] and v["got_ok"] and v["read_ok"], r
        assert [v["ptrs"][p] - v["ptrs"][0] for p in range(world)] == [p * v["stride"] for p in range(world)]
        assert v["live_after"] == empty and v["live_end"] == empty
        assert v["fd_leak"] == [], (r, v["fd_leak"])


def test_peer_writes_visible_same_host() -> None:
    seed, nbytes = random.randrange(1 << 30), GRAN + random.randrange(1, 4096)
    values = raise_on_failure(spawn_local(_rw_worker, 3, args=(seed, nbytes, 10, False), timeout_s=120))
    _check_rw(values, 3)
    assert values[0]["plan"] == ["none", "posix_fd", "posix_fd"]


def _pidfd_getfd_works() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(434, os.getpid(), 0)
    if pidfd < 0:
        return False
    r, w = os.pipe()
    fd = libc.syscall(438, pidfd, r, 0)
    for x in (pidfd, r, w) + ((fd,) if fd >= 0 else ()):
        os.close(x)
    return fd >= 0


def test_peer_writes_visible_across_fake_hosts_with_fabric() -> None:
    if not _pidfd_getfd_works():
        pytest.skip("pidfd_getfd not permitted here (the fake's FABRIC import needs it)")
    seed, nbytes = random.randrange(1 << 30), random.randrange(1, 3 * GRAN)
    results = spawn_local(_rw_worker, 4, args=(seed, nbytes, 3, True), timeout_s=120,
                          extra_env=lambda r: {"EP_COMM_HOST_ID": "a" if r < 2 else "b"})
    values = raise_on_failure(results)
    _check_rw(values, 4)
    assert values[0]["plan"] == ["none", "fabric", "fabric", "fabric"]  # one handle type per allocation


def _cross_host_worker(nbytes: int) -> dict:
    from ep_comm.distributed import init_distributed

    fake = fake_cuda.install(fabric=False)
    topo = init_distributed()
    t0 = time.monotonic()
    try:
        SymmetricBuffer.create(nbytes, None, topo)
    except EPError as exc:
        return {"type": type(exc).__name__, "msg": str(exc), "elapsed": time.monotonic() - t0,
                "allocs": fake.calls.count("cuMemCreate"), "live": fake.live()}
    return {"type": None}


def test_cross_host_without_fabric_refused_everywhere_before_allocating() -> None:
    results = spawn_local(_cross_host_worker, 2, args=(12345,), timeout_s=120,
                          extra_env=lambda r: {"EP_COMM_HOST_ID": f"node{r}"})
    values = raise_on_failure(results)
    assert len({v["msg"] for v in values}) == 1
    for v in values:
        assert v["type"] == "EPTopologyError" and v["elapsed"] < 10
        assert "/dev/nvidia-caps-imex-channels" in v["msg"] and "CUDA_ERROR_NOT_PERMITTED" in v["msg"]
        assert v["allocs"] == 2  # only the probe's two test allocations (POSIX_FD, FABRIC attempt)
        assert v["live"]["handles"] == 0 and v["live"]["ctx_refs"] == 0


def _failure_worker(nbytes: int) -> dict:
    from ep_comm.distributed import init_distributed
    from ep_comm.distributed.exchange import TorchExchange

    fake = fake_cuda.install()
    topo = init_distributed()
    ex = TorchExchange()
    probe_capabilities(ex.rank % 2)  # probe before injecting failures (it allocates too)
    fds_before = _own_fds()
    out = {}
    for call, victim, code in (("cuMemCreate", 1, fake_cuda.CUresult.CUDA_ERROR_OUT_OF_MEMORY),
                               ("cuMemImportFromShareableHandle", 0, fake_cuda.CUresult.CUDA_ERROR_NOT_PERMITTED),
                               ("cuMemMap", 2, fake_cuda.CUresult.CUDA_ERROR_INVALID_VALUE)):
        fake.failures = {call: code} if ex.rank == victim else {}
        t0 = time.monotonic()
        try:
            SymmetricBuffer.create(nbytes, ex, topo, device_index=ex.rank % 2, timeout_s=20)
            out[call] = ("created", "", 0.0)
        except EPError as exc:
            out[call] = (type(exc).__name__, str(exc), time.monotonic() - t0)
        fake.failures = {}
        out[call + ":live"] = fake.live()
    # and the group still works afterwards
    with SymmetricBuffer.create(nbytes, ex, topo, device_index=ex.rank % 2, timeout_s=20) as buf:
        buf.local.fill_(ex.rank + 1)
        ex.barrier()
        out["after"] = [int(buf.peer(p)[0]) for p in range(ex.size)]
        ex.barrier()
    out["fd_leak"] = _fd_leak(fds_before)
    out["live_end"] = fake.live()
    return out


def test_failure_on_one_rank_fails_every_rank_and_leaks_nothing() -> None:
    values = raise_on_failure(spawn_local(_failure_worker, 3, args=(12345,), timeout_s=120))
    empty = {"handles": 0, "reservations": 0, "mappings": 0, "ctx_refs": 0, "ctx_stack": 0}
    expect = {"cuMemCreate": ("allocating", "rank 1", "CUDA_ERROR_OUT_OF_MEMORY"),
              "cuMemImportFromShareableHandle": ("mapping", "rank 0", "CUDA_ERROR_NOT_PERMITTED"),
              "cuMemMap": ("mapping", "rank 2", "CUDA_ERROR_INVALID_VALUE")}
    for call, parts in expect.items():
        assert len({v[call][1] for v in values}) == 1, call  # the same message on every rank
        for v in values:
            kind, msg, elapsed = v[call]
            assert kind == "EPError" and elapsed < 10, (call, v[call])
            assert all(part in msg for part in parts + (call,)), (call, msg)
            assert v[call + ":live"] == empty, call
    for v in values:
        assert v["after"] == [1, 2, 3] and v["fd_leak"] == [] and v["live_end"] == empty
