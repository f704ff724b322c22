"""Choosing a communicator's backend: the same answer on every rank, or the same error on every rank.

Every rank reports what it can run (``local_availability``) and the settings every rank must share
(fields of ``EPConfig`` that size or shape what ranks exchange, and the environment knobs that change
the protocol: a rank that differs would corrupt or wait forever).  One all-gather of those reports
gives every rank the same candidates: the requested backend, or every usable one in ``AUTO_ORDER``.
"""
from __future__ import annotations

import os
import warnings
from typing import Sequence

from .. import backends as registry
from ..config import EPConfig
from ..errors import EPConfigError, EPError, EPTimeoutError, EPTopologyError
from .base import Backend, BackendContext
from .one_sided.layout import COMBINE_GROUPED_ENV, COMBINE_PULL_ENV

#: the reason of a backend that a rank did not report (a rank with another ep_comm install)
UNKNOWN = "unknown on this rank"

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
    reasons = merge_reasons([a for a, _ in reports])
    if requested != "auto":
        why = reasons.get(requested, UNKNOWN)
        if why:
            usable = [n for n in registry.registered() if not reasons.get(n, UNKNOWN)]
            raise EPTopologyError(f"backend {requested!r} cannot run on this group ({why}); usable: {usable}")
        return [requested]
    usable = auto_candidates(reasons)
    if usable:
        return usable
    raise EPTopologyError("no backend usable on every rank: " + "; ".join(f"{n}: {why}" for n, why in reasons.items()))


def merge_reasons(per_rank: Sequence[dict[str, str]]) -> dict[str, str]:
    """Every rank's ``local_availability`` merged per backend (rank 0's backends): "" when every rank
    can run it, the reason alone when every rank gave the same one, else each distinct reason once with
    its ranks (at 72 ranks one reason must not be repeated 72 times)."""
    out: dict[str, str] = {}
    for name in per_rank[0]:
        by_reason: dict[str, list[int]] = {}
        for r, reasons in enumerate(per_rank):
            why = reasons.get(name, UNKNOWN)
            if why:
                by_reason.setdefault(why, []).append(r)
        if not by_reason:
            out[name] = ""
        elif len(by_reason) == 1 and len(next(iter(by_reason.values()))) == len(per_rank):
            out[name] = next(iter(by_reason))
        else:
            out[name] = "; ".join(f"{rank_list(ranks)}: {why}" for why, ranks in by_reason.items())
    return out


def auto_candidates(reasons: dict[str, str]) -> list[str]:
    """What ``backend="auto"`` tries, in order: the backends of ``AUTO_ORDER`` every rank can run."""
    return [name for name in registry.AUTO_ORDER if name in reasons and not reasons[name]]


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
