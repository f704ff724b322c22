"""Variable-size collectives on top of torch.distributed, for NCCL and gloo alike.

NCCL takes uneven all_gather / reduce_scatter lists directly (torch groups them into broadcasts /
reduces); gloo has neither reduce_scatter nor uneven all_gather, so there we issue one broadcast per
source, all asynchronous, and wait for them together, and reduce with one all_reduce.

A control plane's own gloo group (``ControlPlane.gloo_group``: CPU communicators, and the survivors of
a shrink) is not in torch's group table: its collectives are called on the object itself, since the
``torch.distributed`` functions would turn a peer's failure into a ValueError about that table.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


def _own_gloo(group) -> Optional[dist.ProcessGroupGloo]:
    """``group`` when it is a control plane's own gloo group, else None."""
    return group if isinstance(group, dist.ProcessGroupGloo) else None


def is_nccl(group: Optional[dist.ProcessGroup]) -> bool:
    if _own_gloo(group) is not None:
        return False
    return dist.get_backend(group) == "nccl"


def all_reduce(buf: torch.Tensor, group) -> None:
    """Sum ``buf`` over the group's ranks, in place."""
    own = _own_gloo(group)
    if own is not None:
        own.allreduce([buf]).wait()  # type: ignore[attr-defined]
    else:
        dist.all_reduce(buf, group=group)


def all_gather_equal(send: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[world, *send.shape]`` with every rank's ``send``."""
    out = torch.empty((world, *send.shape), dtype=send.dtype, device=send.device)
    own = _own_gloo(group)
    if own is not None:
        own.allgather([list(out.unbind(0))], [send]).wait()  # type: ignore[attr-defined]
    elif is_nccl(group):
        dist.all_gather_into_tensor(out, send, group=group)
    else:
        dist.all_gather(list(out.unbind(0)), send, group=group)
    return out


def all_gatherv(send: torch.Tensor, sizes: Sequence[int], rank: int, group):
    """1-D all_gatherv: group rank r contributes ``sizes[r]`` elements; returns the per-rank tensors."""
    if len(set(sizes)) == 1:
        return list(all_gather_equal(send, len(sizes), group).unbind(0))
    if is_nccl(group):
        outs = [torch.empty(n, dtype=send.dtype, device=send.device) for n in sizes]
        dist.all_gather(outs, send, group=group)
    else:
        outs = [send if r == rank else torch.empty(n, dtype=send.dtype, device=send.device)
                for r, n in enumerate(sizes)]
        works = [_broadcast(outs[r], r, group) for r in range(len(sizes))]
        for w in works:
            if w is not None:
                w.wait()
    return outs


def reduce_scatterv(buf: torch.Tensor, rows: Sequence[int], rank: int, group):
    """Sum ``buf`` (chunks of ``rows[d]`` rows, destination-major) over ranks; return group rank
    ``rank``'s chunk."""
    chunks = list(torch.split(buf, list(rows), dim=0))
    if is_nccl(group):
        out = torch.empty_like(chunks[rank])
        if len(set(rows)) == 1:
            dist.reduce_scatter_tensor(out, buf, group=group)
        else:
            dist.reduce_scatter(out, chunks, group=group)
        return out
    # gloo has no reduce_scatter: one all_reduce of the whole buffer, then this rank's chunk.  One
    # rendezvous of every rank instead of one reduce per destination, which costs far more than the
    # extra volume at CPU sizes
    all_reduce(buf, group)
    return chunks[rank]


def _broadcast(t: torch.Tensor, src: int, group):
    """Start a broadcast of ``t`` from group rank ``src``; its work handle."""
    own = _own_gloo(group)
    if own is None:
        return dist.broadcast(t, group=group, async_op=True, group_src=src)
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    return own.broadcast([t], opts)  # type: ignore[attr-defined]
