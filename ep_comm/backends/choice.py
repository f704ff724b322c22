"""Choosing a communicator's backend: the same answer on every rank, or the same error on every rank.

Every rank reports what it can run (``local_availability``) and the settings every rank must share
(fields of ``EPConfig`` that size or shape what ranks exchange, and the environment knobs that change
the protocol: a rank that differs would corrupt or wait forever).  One all-gather of those reports
gives every rank the same candidates: the requested backend, or every usable one in ``AUTO_ORDER``.
"""
from __future__ import annotations

import os
import warnings

from .. import backends as registry
from ..config import EPConfig
from ..errors import EPConfigError, EPError, EPTimeoutError, EPTopologyError
from .base import Backend, BackendContext
from .one_sided.layout import COMBINE_GROUPED_ENV, COMBINE_PULL_ENV

# timeout_s, num_sms and validate_ids may differ: each rank's own business
_SHARED_FIELDS = ("num_experts", "top_k", "hidden", "max_tokens_per_rank", "dtype", "layout", "quant", "zero_copy")
_SHARED_ENV = (COMBINE_GROUPED_ENV, COMBINE_PULL_ENV)


def create_backend(ctx: BackendContext, requested: str) -> tuple[str, Backend, list[str]]:
    """``(name, backend, skipped)``, collective over the group.  Under ``auto`` a candidate whose
    creation fails alike on every rank with an ``EPError`` (NVSHMEM cannot start, say) gives way to the
    next; ``skipped`` says why."""
    *fallible, last = _candidates(ctx, requested)
    skipped: list[str] = []
    for name in fallible:
        try:
            return name, registry.get_backend(name).create(ctx), skipped
        except EPTimeoutError:
            raise  # a peer is missing: the next candidate would wait for it too
        except EPError as exc:
            skipped.append(f"{name}: {exc}")
            warnings.warn(f"ep_comm: backend='auto' skips {name!r}: {exc}", RuntimeWarning, stacklevel=3)
    return last, registry.get_backend(last).create(ctx), skipped


def _candidates(ctx: BackendContext, requested: str) -> list[str]:
    local = registry.local_availability(ctx)
    reports = ctx.control.gather_objects((local, shared_settings(ctx.cfg, requested)))
    check_shared_settings([s for _, s in reports])
    registry.check_environment()  # (the same values on every rank now: every rank raises alike)
    everyone = [a for a, _ in reports]

    def blocker(name: str) -> str:
        # one entry per distinct reason: at 72 ranks the same reason must not be repeated 72 times
        by_reason: dict[str, list[int]] = {}
        for r, v in enumerate(everyone):
            if v.get(name, "unknown"):
                by_reason.setdefault(v.get(name, "unknown"), []).append(r)
        return "; ".join(f"{rank_list(ranks)}: {why}" for why, ranks in by_reason.items())

    if requested != "auto":
        why = blocker(requested)
        if why:
            usable = [n for n in registry.registered() if not blocker(n)]
            raise EPTopologyError(f"backend {requested!r} cannot run on this group ({why}); usable: {usable}")
        return [requested]
    usable = [name for name in registry.AUTO_ORDER if name in local and not blocker(name)]
    if usable:
        return usable
    raise EPTopologyError("no backend usable on every rank: " + "; ".join(f"{n}: {blocker(n)}" for n in local))


def shared_settings(cfg: EPConfig, requested: str) -> dict:
    out = {f: getattr(cfg, f) for f in _SHARED_FIELDS}
    out["backend"] = requested  # after $EP_COMM_BACKEND
    out.update({f"${name}": os.environ.get(name, "") for name in _SHARED_ENV})
    return out


def check_shared_settings(per_rank: list[dict]) -> None:
    """Raise ``EPConfigError`` (on every rank: all see the same reports) naming the first setting the
    ranks disagree on and which ranks hold which value."""
    for key in per_rank[0]:
        by_value: dict[str, list[int]] = {}
        for r, s in enumerate(per_rank):
            by_value.setdefault(repr(s.get(key, "<missing>")), []).append(r)
        if len(by_value) > 1:
            held = "; ".join(f"{rank_list(ranks)}: {value}" for value, ranks in by_value.items())
            raise EPConfigError(key, per_rank[0].get(key), f"must be the same on every rank of the group ({held})")


def rank_list(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5`` (sorted ranks, runs collapsed)."""
    runs: list[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)
