"""Who runs where: the ``Topology`` of a group of ranks.

Host identity is the host name unless ``EP_COMM_HOST_ID`` overrides it, which lets one machine act as
several hosts in tests (the memory layer then refuses same-host shortcuts between those ranks).
"""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import Mapping, Optional, Sequence

HOST_ID_ENV = "EP_COMM_HOST_ID"


def local_host_id(env: Optional[Mapping[str, str]] = None) -> str:
    env = os.environ if env is None else env
    return env.get(HOST_ID_ENV) or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class Topology:
    """Placement of the ranks of a group.

    ``local_rank``/``local_world_size`` count ranks with the same ``host_id``; ``node_rank`` numbers
    hosts in order of their lowest rank; ``ranks_by_host`` maps each host id to its ranks (ascending).
    ``device_index`` is the CUDA device this rank uses (None on CPU-only runs).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host_id: str
    node_rank: int
    ranks_by_host: Mapping[str, tuple[int, ...]]
    device_index: Optional[int] = None

    @property
    def num_hosts(self) -> int:
        return len(self.ranks_by_host)

    def host_of(self, rank: int) -> str:
        for host, ranks in self.ranks_by_host.items():
            if rank in ranks:
                return host
        raise KeyError(rank)

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of(a) == self.host_of(b)

    @classmethod
    def from_host_ids(cls, rank: int, host_ids: Sequence[str], device_index: Optional[int] = None) -> Topology:
        """Build the topology from every rank's host id (index = rank)."""
        by_host: dict[str, list[int]] = {}
        for r, h in enumerate(host_ids):
            by_host.setdefault(h, []).append(r)
        host = host_ids[rank]
        mine = by_host[host]
        return cls(
            rank=rank,
            world_size=len(host_ids),
            local_rank=mine.index(rank),
            local_world_size=len(mine),
            host_id=host,
            node_rank=list(by_host).index(host),
            ranks_by_host={h: tuple(rs) for h, rs in by_host.items()},
            device_index=device_index,
        )


def gather_topology(group=None, device_index: Optional[int] = None) -> Topology:
    """Collective over ``group`` (default world): all-gather host ids and build the Topology."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return Topology.from_host_ids(0, [local_host_id()], device_index)
    ids: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ids, local_host_id(), group=group)
    return Topology.from_host_ids(dist.get_rank(group), [str(i) for i in ids], device_index)
