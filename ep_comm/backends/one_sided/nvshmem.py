"""``nvshmem``: the one-sided kernels over NVSHMEM's symmetric heap (``ep_comm._C_nvshmem``: the same
kernels compiled with NVSHMEM's device library).  A peer is reached in one of two ways, the same for
every rank of a communicator:

- **stores** through the address ``nvshmem_ptr`` gives (NVLink P2P, mapped by NVSHMEM): one host;
- **puts** (put mode): what would be stored into the peer is written to a staging copy in this rank's
  own heap and moved with ``nvshmemx_putmem_nbi_warp``; flags travel as ``nvshmemx_signal_op``.  Used
  when the ranks span hosts (InfiniBand/RoCE through NVSHMEM's IBGDA/IBRC transports) or
  ``NVSHMEM_DISABLE_P2P`` is set; ``EP_COMM_NVSHMEM_PUT=1`` forces it on NVLink peers too (the network
  code path on one host, for tests).  The buffer is twice as large (staging) and the combine is
  never grouped.
"""
from __future__ import annotations

import functools
import os
from typing import cast

from ...distributed.control import peer_loss_seen
from ...errors import EPError
from ...memory import nvshmem_heap
from .. import extension
from ..base import BackendContext
from .backend import OneSidedBackend, SymmetricMemory

PUT_ENV = "EP_COMM_NVSHMEM_PUT"  # "1": reach every peer with NVSHMEM puts, even where stores would do


def wants_put_mode(ctx: BackendContext) -> bool:
    """Put mode for this communicator (the same answer on every rank: environment and topology)."""
    p2p_off = os.environ.get("NVSHMEM_DISABLE_P2P", "0") not in ("", "0")
    return os.environ.get(PUT_ENV) == "1" or ctx.topology.num_hosts > 1 or p2p_off


@functools.cache
def _ops_unavailable() -> str:
    """'' when ep_comm._C_nvshmem is loaded and built from this package's protocol table."""
    ext, why = nvshmem_heap.extension()
    if ext is None:
        return why
    return extension.fingerprint_mismatch(ext, "ep_comm._C_nvshmem")


class NvshmemMemory:
    """One ``nvshmem_malloc`` per communicator; the NVSHMEM build of the kernels (ops ``nvshmem_*``)."""

    ops_prefix = "nvshmem"

    def unavailable(self, ctx: BackendContext) -> str:
        return _ops_unavailable()

    def put_mode(self, ctx: BackendContext) -> bool:
        put = wants_put_mode(ctx)
        modes = ctx.control.gather_objects(put)
        if len(set(modes)) != 1:
            raise EPError(f"nvshmem backend: ranks disagree on put mode ({PUT_ENV} or NVSHMEM_DISABLE_P2P set "
                          f"on some ranks only): {modes}")
        return put

    def allocate(self, ctx: BackendContext, nbytes: int, put_mode: bool) -> SymmetricMemory:
        buf = nvshmem_heap.NvshmemBuffer.create(nbytes, ctx.control, ctx.topology, ctx.device.index,
                                                put_mode=put_mode)
        if put_mode and buf.pes != tuple(range(ctx.world_size)):
            buf.close(collective=False)
            raise EPError(f"nvshmem backend: put mode needs PE r for rank r; the running NVSHMEM gives "
                          f"{list(buf.pes)} (it was started for another group)")
        return buf

    def release(self, ctx: BackendContext, memory: SymmetricMemory, collective: bool) -> None:
        """nvshmem_free waits for every rank without a timeout, so the ranks first meet on the
        rendezvous store, for up to 2 * timeout_s + 10 s (after a timeout they reach close up to
        timeout_s apart).  After a lost peer or a failed meeting nothing collective runs and the memory
        stays allocated (NVSHMEM is then unusable in this process)."""
        collective = collective and not peer_loss_seen() and _every_rank_releases(ctx, 2 * ctx.cfg.timeout_s + 10)
        cast(nvshmem_heap.NvshmemBuffer, memory).close(collective=collective)


def _every_rank_releases(ctx: BackendContext, wait_s: float) -> bool:
    """Whether every rank of the communicator reached this release within ``wait_s`` (and none is known
    to be gone)."""
    try:
        if ctx.control.lost_peers():
            return False
        ctx.control.meet("release", wait_s)
        return True
    except Exception:  # noqa: BLE001 - a peer missing, or the store (its host) gone: free nothing
        return False


class NvshmemBackend(OneSidedBackend):
    name = "nvshmem"
    memory = NvshmemMemory()
