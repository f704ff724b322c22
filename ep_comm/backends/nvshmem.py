"""``nvshmem``: the one-sided kernels over NVSHMEM's symmetric heap instead of a ``SymmetricBuffer``.

Everything but the memory and how a peer is reached is the ``mnnvl`` backend's: the same kernels
(routing, both layouts, fused fp8, call numbers in the flags, bounded waits, receive hooks, CUDA
graphs), built a second time into ``ep_comm._C_nvshmem`` with NVSHMEM's device library.  A peer is
reached in one of two ways, the same for every rank of a communicator:

- **stores** through the address ``nvshmem_ptr`` gives (NVLink P2P, mapped by NVSHMEM): one host;
- **puts** (put mode): what would be stored into the peer is written to a staging copy in this rank's
  own heap and moved with ``nvshmemx_putmem_nbi_warp``; flags travel as ``nvshmemx_signal_op``.  Used
  when the ranks span hosts (InfiniBand/RoCE through NVSHMEM's IBGDA/IBRC transports) or
  ``NVSHMEM_DISABLE_P2P`` is set; ``EP_COMM_NVSHMEM_PUT=1`` forces it on NVLink peers too (the network
  code path on one host, for tests).  The buffer is twice as large (staging) and the combine is
  never grouped.
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
from .mnnvl import NUM_SMS_ENV, MnnvlBackend, kernels_unavailable


PUT_ENV = "EP_COMM_NVSHMEM_PUT"  # "1": reach every peer with NVSHMEM puts, even where stores would do


def wants_put_mode(ctx: BackendContext) -> bool:
    """Put mode for this communicator (the same answer on every rank: environment and topology)."""
    p2p_off = os.environ.get("NVSHMEM_DISABLE_P2P", "0") not in ("", "0")
    return os.environ.get(PUT_ENV) == "1" or ctx.topology.num_hosts > 1 or p2p_off


class NvshmemBackend(MnnvlBackend):
    name = "nvshmem"
    ops_prefix = "nvshmem"

    @classmethod
    def availability(cls, ctx: BackendContext) -> Availability:
        why = kernels_unavailable(ctx) or kernel_ops.nvshmem_ops_reason()  # (CUDA first: no load on CPU ranks)
        return Availability(not why, why)

    @classmethod
    def create(cls, ctx: BackendContext) -> "NvshmemBackend":
        put = wants_put_mode(ctx)
        modes = ctx.control.gather_objects(put)
        if len(set(modes)) != 1:
            raise EPError(f"nvshmem backend: ranks disagree on put mode ({PUT_ENV} or NVSHMEM_DISABLE_P2P set "
                          f"on some ranks only): {modes}")
        layout = kp.backend_layout(ctx.cfg, ctx.world_size, put_mode=put)
        num_blocks = kp.default_num_blocks(ctx.cfg, ctx.device, os.environ.get(NUM_SMS_ENV))
        buf = nvshmem_heap.NvshmemBuffer.create(layout.nbytes, ctx.control, ctx.topology, ctx.device.index,
                                                put_mode=put)
        try:
            # flags and row headers start at zero (no call has code 0) before any peer may write
            buf.local.zero_()
            torch.cuda.synchronize(ctx.device)
            ctx.control.barrier()
            if put and buf.pes != tuple(range(ctx.world_size)):
                raise EPError(f"nvshmem backend: put mode needs PE r for rank r; the running NVSHMEM gives "
                              f"{list(buf.pes)} (it was started for another group)")
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
