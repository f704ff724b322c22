"""Backends behind one interface (``base.Backend``), grouped by mechanism: ``collective`` (naive, ag_rs)
and ``one_sided`` (mnnvl, nvshmem).  This module is the registry and the choice among them."""
from __future__ import annotations

from .base import Availability, Backend, BackendContext, Capabilities, CombineCall, DispatchCall
from .collective import AllGatherReduceScatterBackend, NaiveBackend
from .one_sided import MnnvlBackend, NvshmemBackend
from .one_sided import check_environment as _check_one_sided_environment

_REGISTRY: dict[str, type[Backend]] = {}

#: order in which ``backend="auto"`` tries backends
AUTO_ORDER = ("mnnvl", "nvshmem", "ag_rs")


def register(cls: type[Backend]) -> type[Backend]:
    _REGISTRY[cls.name] = cls
    return cls


def registered() -> dict[str, type[Backend]]:
    return dict(_REGISTRY)


def get_backend(name: str) -> type[Backend]:
    return _REGISTRY[name]


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
    return out


def check_environment() -> None:
    """``EPConfigError`` for a malformed ``$EP_COMM_*`` setting, raised before any backend is made: under
    ``backend="auto"`` it must not pass for a backend that cannot start."""
    _check_one_sided_environment()


for _cls in (NaiveBackend, AllGatherReduceScatterBackend, MnnvlBackend, NvshmemBackend):
    register(_cls)

__all__ = ["AUTO_ORDER", "Availability", "Backend", "BackendContext", "Capabilities", "CombineCall", "DispatchCall",
           "check_environment", "get_backend", "local_availability", "register", "registered"]
