"""How each rank imports each peer's memory: the handle plan (pure Python, testable on CPU).

Inputs are the group's ``Topology`` and *every* rank's all-gathered ``Capabilities``.  The decision
(and any error, with its message) is a function of those inputs only and checks every pair of ranks,
not just this rank's, so all ranks of a group raise together or none does: a split decision, where
some ranks allocate and exchange handles while others have given up, cannot happen.

Rules: self needs no handle; a group on one host uses POSIX fds (passed over AF_UNIX); a group that
spans hosts uses FABRIC handles, which needs FABRIC permitted on every rank.  POSIX fds and CUDA IPC
handles are never used across hosts.  Inside a host of a multi-host group the peers use POSIX fds
when every rank can request POSIX_FD|FABRIC on one allocation, else FABRIC (cuda-python's handle-type
enum has no combined member today, so an allocation carries one handle type).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from ..distributed.topology import Topology
from ..errors import EPError, EPTopologyError
from .probe import IMEX_CHANNEL_DIR, Capabilities

DEFAULT_FALLBACK_BACKENDS: tuple[str, ...] = ("ag_rs", "naive")

__all__ = ["HandleType", "HandlePlan", "plan_handles", "DEFAULT_FALLBACK_BACKENDS"]


class HandleType(str, enum.Enum):
    """How a peer's allocation reaches this process."""

    NONE = "none"  # our own memory
    POSIX_FD = "posix_fd"  # same host: fd over AF_UNIX + SCM_RIGHTS
    FABRIC = "fabric"  # CUmemFabricHandle bytes (needs an IMEX channel)


@dataclasses.dataclass(frozen=True)
class HandlePlan:
    """The group-wide mapping decision, seen from ``rank``.

    ``peer_handle[p]``: how ``rank`` imports rank p's memory (``NONE`` for itself).
    ``alloc_handles``: handle types every rank requests at cuMemCreate (the same on every rank;
    empty for a group of one, which exports nothing).
    ``granularity``: allocation granularity every rank rounds its size up to (max over ranks).
    """

    rank: int
    world_size: int
    peer_handle: tuple[HandleType, ...]
    alloc_handles: tuple[HandleType, ...]
    granularity: int
    hosts: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def uses_posix_fd(self) -> bool:
        return HandleType.POSIX_FD in self.alloc_handles

    @property
    def uses_fabric(self) -> bool:
        return HandleType.FABRIC in self.alloc_handles

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "peer_handle": [h.value for h in self.peer_handle],
            "alloc_handles": [h.value for h in self.alloc_handles],
            "granularity": self.granularity,
            "hosts": {h: list(rs) for h, rs in self.hosts},
        }


def _ranks_text(ranks: Sequence[int]) -> str:
    """Compact '0-3, 6' for long rank lists (messages on 72 ranks stay readable)."""
    ranks = sorted(ranks)
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts)


def _hosts_text(topology: Topology) -> str:
    return "; ".join(f"host {h!r}: rank(s) {_ranks_text(rs)}" for h, rs in topology.ranks_by_host.items())


def _probe_line(caps: Capabilities) -> str:
    if not caps.cuda:
        return f"no CUDA ({caps.reason})"
    imex = (
        f"{IMEX_CHANNEL_DIR} has {', '.join(caps.imex_channels)}" if caps.imex_channels
        else f"{IMEX_CHANNEL_DIR} {'empty' if caps.imex_channel_dir else 'missing'}"
    )
    fabric = "permitted" if caps.fabric_permitted else f"-> {caps.fabric_error or 'failed'}"
    return (
        f"fabric attribute={int(caps.fabric_supported)}, cuMemCreate(FABRIC) {fabric}, {imex}"
    )


def _grouped_probe(caps: Sequence[Capabilities], ranks: Sequence[int], topology: Topology) -> str:
    by_line: dict[str, list[int]] = {}
    for r in ranks:
        by_line.setdefault(f"{_probe_line(caps[r])} (host {topology.host_of(r)!r})", []).append(r)
    return "; ".join(f"rank(s) {_ranks_text(rs)}: {line}" for line, rs in by_line.items())


def _backends_text(usable_backends: Sequence[str]) -> str:
    return ", ".join(usable_backends) if usable_backends else "none (no fallback backend was offered)"


def plan_handles(
    topology: Topology,
    caps: Sequence[Capabilities],
    usable_backends: Sequence[str] = DEFAULT_FALLBACK_BACKENDS,
) -> HandlePlan:
    """Decide, identically on every rank, which handle type each rank uses for each peer.

    ``caps[r]`` is rank r's probe (all-gathered); ``usable_backends`` are the backends that would
    work without mapped peer memory (e.g. ``("ag_rs", "naive", "nvshmem")``), named in errors.
    Raises ``EPTopologyError`` (on every rank alike) when some pair of ranks cannot be mapped.
    """
    world = topology.world_size
    if len(caps) != world:
        raise EPError(f"plan_handles: {len(caps)} capability records for a group of {world} ranks")
    fallback = _backends_text(usable_backends)
    all_ranks = range(world)

    no_cuda = [r for r in all_ranks if not caps[r].cuda]
    if no_cuda:
        raise EPTopologyError(
            f"cuMem VMM mapping needs a CUDA GPU on every rank, but rank(s) {_ranks_text(no_cuda)} have "
            f"none ({_grouped_probe(caps, no_cuda, topology)}). Backends that would work: {fallback}."
        )
    no_vmm = [r for r in all_ranks if not caps[r].vmm_supported]
    if no_vmm:
        raise EPTopologyError(
            f"rank(s) {_ranks_text(no_vmm)}: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=0, "
            f"cuMem VMM mapping is impossible. Backends that would work: {fallback}."
        )

    # Same-host pairs need GPU peer access whatever the handle type.
    for host, ranks in topology.ranks_by_host.items():
        for a in ranks:
            for b in ranks:
                if a != b and caps[a].can_access(caps[b].pci_bus_id) is False:
                    raise EPTopologyError(
                        f"rank {a} (GPU {caps[a].pci_bus_id}) cannot access rank {b}'s GPU "
                        f"({caps[b].pci_bus_id}) on host {host!r}: cuDeviceCanAccessPeer=0, so its memory "
                        f"cannot be mapped. Backends that would work: {fallback}."
                    )

    multi_host = topology.num_hosts > 1
    if not multi_host:
        no_fd = [r for r in all_ranks if not caps[r].posix_fd_permitted]
        if no_fd and world > 1:
            detail = "; ".join(f"rank {r}: {caps[r].posix_fd_error or 'failed'}" for r in no_fd)
            raise EPTopologyError(
                f"same-host peers need POSIX file-descriptor handles, but cuMemCreate/export with "
                f"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR failed on rank(s) {_ranks_text(no_fd)} ({detail}). "
                f"Backends that would work: {fallback}."
            )
        # a group of one exports nothing, so it requests no handle type at all
        alloc: tuple[HandleType, ...] = (HandleType.POSIX_FD,) if world > 1 else ()
        same_host = HandleType.POSIX_FD
    else:
        no_fabric = [r for r in all_ranks if not caps[r].fabric_permitted]
        if no_fabric:
            raise EPTopologyError(
                f"ranks span {topology.num_hosts} hosts ({_hosts_text(topology)}); mapping a peer's GPU "
                f"memory across hosts needs FABRIC handles, but FABRIC handles were not permitted on ranks "
                f"{_ranks_text(no_fabric)} (cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC returns "
                f"CUDA_ERROR_NOT_PERMITTED without an IMEX channel). Probe: "
                f"{_grouped_probe(caps, no_fabric, topology)}. FABRIC handles need an IMEX channel "
                f"({IMEX_CHANNEL_DIR}/channelN present and accessible in every container) and, across "
                f"nodes, the nvidia-imex daemon running with every node in its config. POSIX fds and "
                f"CUDA IPC handles are never sent across hosts. Backends that would work: {fallback}."
            )
        mixed = all(c.combined_handle_types and c.posix_fd_permitted for c in caps)
        alloc = (HandleType.POSIX_FD, HandleType.FABRIC) if mixed else (HandleType.FABRIC,)
        same_host = HandleType.POSIX_FD if mixed else HandleType.FABRIC

    me = topology.rank
    peer_handle = tuple(
        HandleType.NONE if p == me
        else same_host if topology.same_host(me, p)
        else HandleType.FABRIC
        for p in all_ranks
    )
    grans = [c.granularity for c in caps]
    if HandleType.FABRIC in alloc:
        grans += [c.fabric_granularity for c in caps]
    granularity = max([g for g in grans if g > 0], default=0)
    if granularity <= 0:
        raise EPError("plan_handles: no rank reported an allocation granularity")
    return HandlePlan(
        rank=me,
        world_size=world,
        peer_handle=peer_handle,
        alloc_handles=alloc,
        granularity=granularity,
        hosts=tuple((h, tuple(rs)) for h, rs in topology.ranks_by_host.items()),
    )
