"""SymmetricBuffer and the probe on real GPUs (written for 2×H200; skipped without CUDA).

Each multi-GPU test spawns 2 ranks with NCCL (every child calls init_distributed itself).
"""
from __future__ import annotations

import random
import time

import pytest

from ep_comm.distributed.spawn import raise_on_failure, spawn_local

MiB = 1 << 20


def _rw_worker(seed: int, nbytes: int) -> dict:
    import torch

    from ep_comm.distributed import init_distributed
    from ep_comm.distributed.exchange import TorchExchange
    from ep_comm.memory import SymmetricBuffer

    topo = init_distributed()
    ex = TorchExchange()
    rank, world = ex.rank, ex.size
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(seed)
    own = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(world)]
    sent = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(world)]
    key = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(dev)
    dst, src = (rank + 1) % world, (rank - 1) % world
    checks: dict[str, bool] = {}
    with SymmetricBuffer.create(nbytes, ex, topo) as buf:
        checks["devices"] = all(buf.peer(p).device == dev for p in range(world)) and buf.local.device == dev
        checks["shapes"] = all(buf.peer(p).shape == (nbytes,) and buf.peer(p).dtype == torch.uint8
                               for p in range(world))
        checks["peer_ptrs"] = (buf.peer_ptrs.device == dev and buf.peer_ptrs.dtype == torch.int64
                               and buf.peer_ptrs.tolist() == [buf.peer(p).data_ptr() for p in range(world)])
        checks["local_is_own_slot"] = buf.local.data_ptr() == buf.ptr(rank)

        # 1. every rank fills its own memory; every rank reads every peer's through the mapping
        buf.local.copy_(own[rank].to(dev))
        torch.cuda.synchronize()
        ex.barrier()
        checks["read_through_mapping"] = all(torch.equal(buf.peer(p).cpu(), own[p]) for p in range(world))
        ex.barrier()

        # 2. SM stores over NVLink: an elementwise kernel on this GPU writes into the next rank's memory
        torch.bitwise_xor(sent[rank].to(dev), key, out=buf.peer(dst))
        torch.cuda.synchronize()
        ex.barrier()
        checks["kernel_store_received"] = torch.equal((buf.local ^ key).cpu(), sent[src])
        ex.barrier()

        # 3. the reverse direction with copy_ on the current stream
        buf.peer(src).copy_(own[rank].to(dev))
        torch.cuda.synchronize()
        ex.barrier()
        checks["copy_store_received"] = torch.equal(buf.local.cpu(), own[dst])
        ex.barrier()  # nobody unmaps while a peer may still touch its memory
    return checks


@pytest.mark.gpu
@pytest.mark.multigpu
def test_peer_stores_through_mapping_both_directions() -> None:
    seed = random.randrange(1 << 30)
    nbytes = 3 * MiB + random.randrange(1, 64 * 1024)  # not a multiple of the 2 MiB granularity
    values = raise_on_failure(spawn_local(_rw_worker, 2, args=(seed, nbytes), timeout_s=300))
    for rank, checks in enumerate(values):
        assert all(checks.values()), (rank, checks)


def _cross_host_worker(nbytes: int) -> dict:
    from ep_comm.distributed import init_distributed
    from ep_comm.errors import EPTopologyError
    from ep_comm.memory import SymmetricBuffer, probe_capabilities

    topo = init_distributed()
    if probe_capabilities().fabric_permitted:
        return {"skip": True}
    t0 = time.monotonic()
    try:
        SymmetricBuffer.create(nbytes, None, topo)
    except EPTopologyError as exc:
        return {"skip": False, "msg": str(exc), "elapsed": time.monotonic() - t0, "hosts": topo.num_hosts}
    return {"skip": False, "msg": None}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_fake_cross_host_without_fabric_fails_on_every_rank() -> None:
    results = spawn_local(_cross_host_worker, 2, args=(4 * MiB,), timeout_s=300,
                          extra_env=lambda r: {"EP_COMM_HOST_ID": f"fake-node-{r}"})
    values = raise_on_failure(results)
    if all(v["skip"] for v in values):
        pytest.skip("FABRIC handles are permitted here (IMEX channel present): nothing to refuse")
    msgs = {v["msg"] for v in values}
    assert None not in msgs and len(msgs) == 1, msgs
    for v in values:
        assert v["hosts"] == 2 and v["elapsed"] < 10, v
        assert "/dev/nvidia-caps-imex-channels" in v["msg"] and "CUDA_ERROR_NOT_PERMITTED" in v["msg"]
        assert "ag_rs" in v["msg"] and "naive" in v["msg"]


def _cycles_worker(cycles: int, nbytes: int) -> dict:
    import torch

    from ep_comm.distributed import init_distributed
    from ep_comm.distributed.exchange import TorchExchange
    from ep_comm.memory import SymmetricBuffer

    topo = init_distributed()
    ex = TorchExchange()
    dev = torch.cuda.current_device()

    def settle() -> int:
        torch.cuda.synchronize()
        ex.barrier()  # every peer has closed (released its imports of our memory)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(dev)[0]

    buf = SymmetricBuffer.create(nbytes, ex, topo)  # warm-up: caching allocator, contexts, probe
    buf.local.fill_(1)
    gran, stride = buf.plan.granularity, buf.stride
    buf.close()
    del buf
    free_before = settle()
    t0 = time.monotonic()
    for i in range(cycles):
        buf = SymmetricBuffer.create(nbytes, ex, topo)
        buf.local.fill_(i % 251)
        buf.close()
        del buf
    elapsed = time.monotonic() - t0
    free_after = settle()
    return {"free_before": free_before, "free_after": free_after, "gran": gran, "stride": stride,
            "elapsed": elapsed}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_create_close_cycles_do_not_leak_device_memory() -> None:
    values = raise_on_failure(spawn_local(_cycles_worker, 2, args=(100, 5 * MiB + 3), timeout_s=600))
    for rank, v in enumerate(values):
        assert v["stride"] >= 5 * MiB + 3
        assert abs(v["free_after"] - v["free_before"]) <= v["gran"], (rank, v)


@pytest.mark.gpu
def test_probe_reports_coherent_capabilities() -> None:
    import torch

    from ep_comm.memory import Capabilities, memory_report, peer_access_matrix, probe_capabilities

    caps = probe_capabilities(0, refresh=True)
    assert caps.cuda and caps.device_index == 0 and caps.vmm_supported, caps
    assert caps.posix_fd_supported and caps.posix_fd_permitted and caps.posix_fd_error == "", caps
    assert caps.granularity > 0 and caps.granularity & (caps.granularity - 1) == 0
    assert caps.fabric_supported or not caps.fabric_permitted  # permitted implies supported
    if caps.fabric_supported and not caps.fabric_permitted:
        assert caps.fabric_error, caps
        assert "fabric supported but not permitted" in caps.fabric_summary()
    if "H200" in caps.device_name:  # the machines of docs/performance.md: attribute 1, no IMEX channel
        assert caps.fabric_supported and not caps.fabric_permitted
        assert caps.fabric_error == "CUDA_ERROR_NOT_PERMITTED" and caps.granularity == 2 * MiB
    assert Capabilities.from_bytes(caps.to_bytes()) == caps
    matrix = peer_access_matrix()
    assert len(matrix) == torch.cuda.device_count() and all(matrix[i][i] for i in range(len(matrix)))
    report = memory_report(device_index=0)
    assert caps.pci_bus_id in report and "handle per peer" in report


@pytest.mark.gpu
def test_single_rank_buffer_on_gpu() -> None:
    import torch

    from ep_comm.distributed.exchange import LocalExchange
    from ep_comm.memory import SymmetricBuffer

    nbytes = MiB + random.randrange(1, 4096)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    with SymmetricBuffer.create(nbytes, LocalExchange(), device_index=0) as buf:
        buf.local.copy_(data)
        torch.cuda.synchronize()
        assert torch.equal(buf.peer(0), data)
        assert buf.peer_ptrs.tolist() == [buf.local.data_ptr()]
    assert buf.closed

