"""The collective family's host agreement: every eager call is agreed with the peers before data moves.

One exchange of (op, epoch, status, T) over the communicator's control plane gives every rank the
typed timeout naming a missing peer, the check that every rank is on the same call, every rank's
input error (so nobody is left waiting in a collective that a faulty rank never enters) and every
rank's token count for the variable-size collectives.  CUDA-graph captures make no host round trip:
their calls are checked on the device (``packing`` headers).
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from ...distributed.control import OP_NAMES, ControlPlane, PeerStatus
from ...errors import EPError


class HostAgreement:
    def __init__(self, control: ControlPlane):
        self.control = control

    def agree(self, op: int, epoch: int, num_tokens: int, error: Optional[BaseException] = None) -> list[PeerStatus]:
        """Every rank's record.  Raises on every rank when any rank reports an error (this rank: its
        own ``error``), or a peer is on another call or missing."""
        return self.control.agree_start(op, epoch, num_tokens, error)()

    def tell_peers(self, op: int, epoch: int, exc: BaseException) -> None:
        """Local work failed before this rank's record went out: send it with the failure, so the peers
        raise instead of waiting in the collective; the caller then raises its own error."""
        try:
            self.agree(op, epoch, 0, EPError(f"local {OP_NAMES.get(op, op)} work failed: {exc!r}"))
        except Exception:  # noqa: BLE001 - the local error is the one to report
            pass

    def transport_failure(self, op: int, epoch: int, exc: Exception, capturing: bool) -> Exception:
        """What to raise when the data movement failed after the peers had agreed.

        A collective that fails in eager mode means a peer died or left mid-call (every rank had just
        arrived): that becomes the control plane's typed error naming it.  Other errors, and anything
        raised while capturing a CUDA graph, pass through unchanged."""
        if capturing or isinstance(exc, EPError) or not _is_transport_error(exc):
            return exc
        return self.control.failure(op, epoch, exc)


def _is_transport_error(exc: BaseException) -> bool:
    """A torch.distributed failure (peer gone, connection lost, collective timed out), not a bug."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        m in text for m in ("gloo", "nccl", "connection", "timed out", "broken pipe", "socket"))
