"""Variable-size collectives on top of torch.distributed, for NCCL and gloo alike.

NCCL takes uneven all_gather / reduce_scatter lists directly (torch groups them into broadcasts /
reduces); gloo has neither reduce_scatter nor uneven all_gather, so there we issue one broadcast per
source, all asynchronous, and wait for them together, and reduce with one all_reduce.

A control plane's own groups (``ControlPlane.gloo_group``: CPU communicators and their survivors;
``ControlPlane.nccl_group``: CUDA communicators and their survivors) are not in torch's group table:
their collectives are called on the object itself, as the ``torch.distributed`` functions would call
them (the same methods and options, then ``work.wait()``, which under CUDA-graph capture only joins
the streams), since those functions look the group up in that table, which would turn a peer's failure
into a ValueError about it.  A caller's registered group still goes through the functions.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ...distributed.groups import is_own_nccl


def _own_gloo(group) -> Optional[dist.ProcessGroupGloo]:
    """``group`` when it is a control plane's own gloo group, else None."""
    return group if isinstance(group, dist.ProcessGroupGloo) else None


def _own_nccl(group) -> Optional[Any]:
    """``group`` when it is a control plane's own ``ProcessGroupNCCL``, else None (also on torch builds
    without NCCL, where the class does not exist)."""
    return group if is_own_nccl(group) else None


def _sync_opts(kind: str) -> Any:
    """``c10d.<kind>()`` as the ``torch.distributed`` functions fill it for a synchronous call: a sum, and
    ``asyncOp`` False where torch has it (the collective then runs on the caller's stream)."""
    opts = getattr(c10d, kind)()
    if hasattr(opts, "reduceOp"):
        opts.reduceOp = dist.ReduceOp.SUM
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


def _wait(work: Any) -> None:
    """``work.wait()``, as the functions do for a synchronous call (some torch versions return no work
    for one that already ran on the caller's stream)."""
    if work is not None:
        work.wait()


def is_nccl(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` moves data over NCCL: an own ``ProcessGroupNCCL`` (recognised by its class; it is
    not in torch's table, so ``dist.get_backend`` is never asked about it) or a registered NCCL group."""
    if _own_nccl(group) is not None:
        return True
    if _own_gloo(group) is not None:
        return False
    return dist.get_backend(group) == "nccl"


def carries_cuda_over_nccl(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether a caller's registered group moves CUDA tensors over NCCL: its backend is "nccl", or a
    device map naming NCCL for CUDA (``"cpu:gloo,cuda:nccl"``, torch's default with CUDA)."""
    backend = str(dist.get_backend(group))
    return backend == "nccl" or "cuda:nccl" in backend


def all_reduce(buf: torch.Tensor, group) -> None:
    """Sum ``buf`` over the group's ranks, in place."""
    own = _own_gloo(group)
    nccl = _own_nccl(group)
    if own is not None:
        own.allreduce([buf]).wait()  # type: ignore[attr-defined]
    elif nccl is not None:
        _wait(nccl.allreduce([buf], _sync_opts("AllreduceOptions")))
    else:
        dist.all_reduce(buf, group=group)


def all_gather_equal(send: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[world, *send.shape]`` with every rank's ``send``."""
    out = torch.empty((world, *send.shape), dtype=send.dtype, device=send.device)
    own = _own_gloo(group)
    nccl = _own_nccl(group)
    if own is not None:
        own.allgather([list(out.unbind(0))], [send]).wait()  # type: ignore[attr-defined]
    elif nccl is not None:  # all_gather_into_tensor
        _wait(nccl._allgather_base(out, send, _sync_opts("AllgatherOptions")))
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
        nccl = _own_nccl(group)
        if nccl is not None:  # all_gather over a list of uneven outputs
            _wait(nccl.allgather([outs], [send], _sync_opts("AllgatherOptions")))
        else:
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
        nccl = _own_nccl(group)
        if nccl is not None:
            opts = _sync_opts("ReduceScatterOptions")
            if len(set(rows)) == 1:  # reduce_scatter_tensor
                _wait(nccl._reduce_scatter_base(out, buf, opts))
            else:
                _wait(nccl.reduce_scatter([out], [chunks], opts))
        elif len(set(rows)) == 1:
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
