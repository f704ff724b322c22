"""``mnnvl``: the one-sided kernels over a ``SymmetricBuffer``: cuMem VMM memory that every rank maps,
exchanged as POSIX fds inside a host and as FABRIC handles across the hosts of an NVL72 rack."""
from __future__ import annotations

from typing import cast

from ...memory.probe import IMEX_CHANNEL_DIR, probe_capabilities
from ...memory.symmetric import SymmetricBuffer
from ..base import BackendContext
from .backend import OneSidedBackend, SymmetricMemory


class MappedMemory:
    """Peers' buffers mapped into this process; the plain build of the kernels (ops ``mnnvl_*``)."""

    ops_prefix = "mnnvl"

    def unavailable(self, ctx: BackendContext) -> str:
        caps = probe_capabilities(ctx.device.index)
        if not caps.cuda or not caps.vmm_supported:
            return f"cuMem VMM unusable on this GPU ({caps.reason or 'VMM not supported'})"
        topo = ctx.topology
        if topo.num_hosts > 1 and not caps.fabric_permitted:
            return (f"ranks span {topo.num_hosts} hosts and peers on other hosts can only be mapped with FABRIC "
                    f"handles, which this rank cannot create: {caps.fabric_summary()}. FABRIC handles need an IMEX "
                    f"channel ({IMEX_CHANNEL_DIR}/channelN present in the container) and, across nodes, the "
                    f"nvidia-imex daemon")
        if topo.local_world_size > 1 and not (caps.posix_fd_permitted or caps.fabric_permitted):
            return f"same-host peers need POSIX fd handles: cuMemCreate/export failed ({caps.posix_fd_error})"
        return ""

    def put_mode(self, ctx: BackendContext) -> bool:
        return False

    def allocate(self, ctx: BackendContext, nbytes: int, put_mode: bool) -> SymmetricMemory:
        return SymmetricBuffer.create(nbytes, ctx.control, ctx.topology, ctx.device.index,
                                      usable_backends=("ag_rs", "naive"), timeout_s=ctx.cfg.timeout_s)

    def release(self, ctx: BackendContext, memory: SymmetricMemory, collective: bool) -> None:
        cast(SymmetricBuffer, memory).close()  # synchronises first, so no kernel still writes the mapped words


class MnnvlBackend(OneSidedBackend):
    name = "mnnvl"
    memory = MappedMemory()
