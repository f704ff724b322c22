"""Backend registry.  A backend is a class following ``base.Backend``; later backends call ``register``."""
from __future__ import annotations

from typing import Type

from .ag_rs import AllGatherReduceScatterBackend
from .base import Availability, Backend, Capabilities, BackendContext, KernelBackend, RoutedBatch
from .kernel_protocol import check_environment
from .mnnvl import MnnvlBackend
from .naive import NaiveBackend
from .nvshmem import NvshmemBackend

_REGISTRY: dict[str, Type] = {}

#: order in which ``backend="auto"`` tries backends (docs/design.md §12)
AUTO_ORDER = ("mnnvl", "nvshmem", "ag_rs")

#: backends of the contract that are not part of this build yet, with the reason shown to users
NOT_BUILT: dict[str, str] = {}


def register(cls: Type) -> Type:
    _REGISTRY[cls.name] = cls
    NOT_BUILT.pop(cls.name, None)
    return cls


def local_availability(ctx: BackendContext) -> dict[str, str]:
    """``{name: ""}`` for each backend this rank can run, ``{name: reason}`` for the others.

    Local and side-effect free; a probe that raises becomes a reason, so no rank ever leaves a
    collective agreement early because of it.
    """
    out: dict[str, str] = {}
    for name, cls in _REGISTRY.items():
        try:
            a = cls.availability(ctx)
            out[name] = "" if a.ok else (a.reason or "unavailable (no reason given)")
        except Exception as exc:  # noqa: BLE001
            out[name] = f"availability probe raised {type(exc).__name__}: {exc}"
    out.update(NOT_BUILT)
    return out


def get_backend(name: str) -> Type:
    return _REGISTRY[name]


def registered() -> dict[str, Type]:
    return dict(_REGISTRY)


register(NaiveBackend)
register(AllGatherReduceScatterBackend)
register(MnnvlBackend)
register(NvshmemBackend)

__all__ = ["Availability", "Backend", "Capabilities", "BackendContext", "KernelBackend", "RoutedBatch", "check_environment", "register",
           "get_backend", "registered",
           "local_availability", "AUTO_ORDER", "NOT_BUILT"]
