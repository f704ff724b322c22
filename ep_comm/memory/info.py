"""What ``ep-comm info`` shows about the memory layer: probe results and the handle type per peer.

Collective when the exchange has more than one rank (every rank must call it); on a machine without
CUDA it reports "no CUDA" instead of failing.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from ..distributed.exchange import Exchange, LocalExchange, close_exchange, exchange_from
from ..distributed.topology import Topology, local_host_id
from ..errors import EPError
from .plan import DEFAULT_FALLBACK_BACKENDS, plan_handles
from .probe import Capabilities, peer_access_matrix, probe_capabilities

__all__ = ["memory_info", "memory_report"]


def _default_exchange(exchange: Any) -> Exchange:
    if exchange is not None:
        return exchange_from(exchange)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return exchange_from(None)
    except ImportError:
        pass
    return LocalExchange()  # a report of this process alone, even under a multi-rank launcher


def memory_info(
    exchange: Any = None,
    device_index: Optional[int] = None,
    usable_backends: Sequence[str] = DEFAULT_FALLBACK_BACKENDS,
) -> dict[str, Any]:
    """Probe this rank, all-gather every rank's probe and compute the handle plan.

    Returns ``{"rank", "world_size", "hosts": {host: [ranks]}, "capabilities": [per-rank dict],
    "peer_access": [[bool]] (this host's GPUs), "plan": dict | None, "plan_error": str | None,
    "cuda": bool}``.
    """
    ex = _default_exchange(exchange)
    try:
        return _memory_info(ex, device_index, usable_backends)
    finally:
        if ex is not exchange:  # made here from None / a ProcessGroup
            close_exchange(ex)


def _memory_info(ex: Exchange, device_index: Optional[int], usable_backends: Sequence[str]) -> dict[str, Any]:
    try:
        caps = probe_capabilities(device_index)
    except Exception as exc:  # the report must still come out (and peers must not wait forever)
        caps = Capabilities(cuda=False, reason=f"probe failed: {exc}")
    mine = {"host": local_host_id(), "caps": caps.to_dict()}
    infos = [json.loads(raw.decode()) for raw in ex.allgather_bytes(json.dumps(mine).encode())]
    topo = Topology.from_host_ids(ex.rank, [i["host"] for i in infos], caps.device_index if caps.cuda else None)
    all_caps = [Capabilities.from_dict(i["caps"]) for i in infos]
    plan: Optional[dict] = None
    plan_error: Optional[str] = None
    try:
        plan = plan_handles(topo, all_caps, usable_backends).to_dict()
    except EPError as exc:
        plan_error = f"{type(exc).__name__}: {exc}"
    return {
        "rank": ex.rank,
        "world_size": ex.size,
        "cuda": caps.cuda,
        "hosts": {h: list(rs) for h, rs in topo.ranks_by_host.items()},
        "capabilities": [c.to_dict() for c in all_caps],
        "peer_access": peer_access_matrix() if caps.cuda else [],
        "plan": plan,
        "plan_error": plan_error,
    }


def _cap_lines(r: int, c: dict, host: str) -> list[str]:
    caps = Capabilities.from_dict(c)
    if not caps.cuda:
        return [f"  rank {r} ({host}): no CUDA ({caps.reason})"]
    imex = ", ".join(caps.imex_channels) or ("empty" if caps.imex_channel_dir else "missing")
    return [
        f"  rank {r} ({host}): GPU {caps.device_index} {caps.device_name} [{caps.pci_bus_id}], "
        f"driver {caps.driver_version}",
        f"    VMM supported: {caps.vmm_supported}; granularity {caps.granularity} B",
        f"    POSIX fd: attribute={int(caps.posix_fd_supported)}, permitted={caps.posix_fd_permitted}"
        + (f" ({caps.posix_fd_error})" if caps.posix_fd_error else ""),
        f"    FABRIC: attribute={int(caps.fabric_supported)}, permitted={caps.fabric_permitted}: "
        f"{caps.fabric_summary()}",
        f"    IMEX channels (/dev/nvidia-caps-imex-channels): {imex}",
    ]


def memory_report(
    exchange: Any = None,
    device_index: Optional[int] = None,
    usable_backends: Sequence[str] = DEFAULT_FALLBACK_BACKENDS,
) -> str:
    """Human-readable ``memory_info``: per-rank probe, peer access, and the handle type per peer."""
    info = memory_info(exchange, device_index, usable_backends)
    host_of = {r: h for h, rs in info["hosts"].items() for r in rs}
    lines = [f"memory (cuMem VMM), rank {info['rank']} of {info['world_size']}:"]
    if not info["cuda"]:
        lines.append(f"  no CUDA: {Capabilities.from_dict(info['capabilities'][info['rank']]).reason}")
    for r, c in enumerate(info["capabilities"]):
        lines += _cap_lines(r, c, host_of[r])
    matrix = info["peer_access"]
    if matrix:
        lines.append("  peer access (row GPU can access column GPU): "
                     + " | ".join("".join("1" if ok else "0" for ok in row) for row in matrix))
    if info["plan"] is not None:
        plan = info["plan"]
        per_peer = ", ".join(f"{p}:{h}" for p, h in enumerate(plan["peer_handle"]))
        alloc = "+".join(plan["alloc_handles"]) or "none"
        lines.append(f"  handle per peer (rank:type): {per_peer}; allocation handle types: {alloc}; "
                     f"granularity {plan['granularity']} B")
    else:
        lines.append(f"  peers cannot be mapped: {info['plan_error']}")
    return "\n".join(lines)
