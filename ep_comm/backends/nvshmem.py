"""``nvshmem``: the one-sided kernels over NVSHMEM's symmetric heap instead of a ``SymmetricBuffer``.

Everything but where the buffer lives is the ``mnnvl`` backend's: the same kernels (routing, both
layouts, fused fp8, call numbers in the flags, bounded waits, receive hooks, CUDA graphs), reaching
each peer's copy of the heap through the address ``nvshmem_ptr`` gives (NVLink P2P, mapped by
NVSHMEM).  For engines that already run NVSHMEM (one heap, one bootstrap), for machines where cuMem
handle export is refused but NVSHMEM's own mapping works, and as the base of a network put path.

Limits of this version: every peer must be reachable by loads and stores (one host, or an NVLink
domain NVSHMEM maps); peers behind a network (InfiniBand/RoCE puts) are not supported yet, so the
backend says it is unavailable there and ``auto`` falls back to ``ag_rs``.
"""
from __future__ import annotations

import os

import torch

from ..distributed.control import peer_loss_seen
from ..errors import EPError, EPTimeoutError
from ..memory import nvshmem_heap
from . import kernel_ops
from . import kernel_protocol as kp
from .base import Availability, BackendContext
from .mnnvl import NUM_SMS_ENV, MnnvlBackend


class NvshmemBackend(MnnvlBackend):
    name = "nvshmem"

    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        if ctx.device.type != "cuda":
            return Availability(False, f"needs CUDA tensors (this communicator runs on {ctx.device.type})")
        why = kernel_ops.unavailable_reason() or nvshmem_heap.unavailable_reason()
        if why:
            return Availability(False, why)
        if ctx.cfg.top_k > kp.MAX_TOP_K:
            return Availability(False, f"top_k={ctx.cfg.top_k} exceeds the kernels' limit of {kp.MAX_TOP_K}")
        if ctx.num_local_experts > kp.MAX_LOCAL_EXPERTS:
            return Availability(False, f"{ctx.num_local_experts} experts per rank exceed the kernels' limit of "
                                       f"{kp.MAX_LOCAL_EXPERTS}")
        if ctx.topology.num_hosts > 1:
            return Availability(False, (
                f"ranks span {ctx.topology.num_hosts} hosts: this version reaches peers only by NVLink "
                "loads/stores (nvshmem_ptr), not by NVSHMEM network puts; use ag_rs (or mnnvl with an IMEX "
                "channel on an NVL72)"))
        if os.environ.get("NVSHMEM_DISABLE_P2P", "0") not in ("", "0"):
            return Availability(False, "NVSHMEM_DISABLE_P2P is set: peers would need network puts, which this "
                                       "version does not issue")
        return Availability(True)

    @classmethod
    def create(cls, ctx: BackendContext) -> "NvshmemBackend":
        layout = kp.BufferLayout.for_config(ctx.cfg, ctx.world_size)
        num_blocks = kp.default_num_blocks(ctx.cfg, ctx.device, os.environ.get(NUM_SMS_ENV))
        buf = nvshmem_heap.NvshmemBuffer.create(layout.nbytes, ctx.control, ctx.topology, ctx.device.index)
        try:
            # flags and row headers start at zero (no call has code 0) before any peer may write
            buf.local.zero_()
            torch.cuda.synchronize(ctx.device)
            ctx.control.barrier()
            return cls(ctx, buf, layout, num_blocks)
        except BaseException:
            buf.close(collective=False)
            raise

    def close(self) -> None:
        """Free the heap memory with the other ranks.  nvshmem_free waits for every rank without a
        timeout, so the ranks first meet on the control plane (bounded by timeout_s); after a lost
        peer, a timeout or a failed meeting nothing collective runs and the memory stays allocated."""
        collective = not isinstance(self._fatal, EPTimeoutError) and not peer_loss_seen()
        try:
            if collective:
                try:
                    self.ctx.control.barrier()
                except EPError:
                    collective = False
        finally:
            try:
                self.buffer.close(collective=collective)
            finally:
                self._mapped.release()
