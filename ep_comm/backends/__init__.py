"""Backend registry.  A backend is a class following ``base.Backend``; later backends call ``register``."""
from __future__ import annotations

from typing import Type

from .ag_rs import AllGatherReduceScatterBackend
from .base import Availability, Backend, BackendContext, RoutedBatch
from .naive import NaiveBackend

_REGISTRY: dict[str, Type] = {}

#: order in which ``backend="auto"`` tries backends (DESIGN §1)
AUTO_ORDER = ("mnnvl", "nvshmem", "ag_rs")

#: backends of the contract that are not part of this build yet, with the reason shown to users
NOT_BUILT = {
    "mnnvl": "not implemented yet (one-sided NVLink over cuMem VMM; memory layer in ep_comm.memory)",
    "nvshmem": "not implemented yet (NVSHMEM low-latency backend)",
}


def register(cls: Type) -> Type:
    _REGISTRY[cls.name] = cls
    NOT_BUILT.pop(cls.name, None)
    return cls


def get_backend(name: str) -> Type:
    return _REGISTRY[name]


def registered() -> dict[str, Type]:
    return dict(_REGISTRY)


register(NaiveBackend)
register(AllGatherReduceScatterBackend)

__all__ = ["Availability", "Backend", "BackendContext", "RoutedBatch", "register", "get_backend", "registered",
           "AUTO_ORDER", "NOT_BUILT"]
