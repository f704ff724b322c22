"""Which backends every rank can run, asked once and agreed by all ranks (``ep-comm info`` and ``bench``).

Each rank runs the backends' own local probes (``ep_comm.backends.local_availability``: no
communication, no allocation); one all-gather then gives every rank the same answer, so the ranks
take the same decisions from it (which rows ``bench`` runs, what ``info`` reports).
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..backends import AUTO_ORDER, BackendContext, local_availability
from ..backends.choice import auto_candidates, merge_reasons
from ..config import EPConfig
from ..distributed.control import ControlPlane
from ..errors import EPConfigError
from .launcher import RankEnv, gather_objects


def local_reasons(env: RankEnv, cfgs: Sequence[EPConfig], timeout_s: float) -> tuple[list[dict[str, str]], str]:
    """This rank's ``{backend: ""}`` (can run) or ``{backend: reason}`` per config in ``cfgs``, and how
    eager calls of the collective backends agree on the host (``ControlPlane.agreement``).

    Collective over the CLI's ranks: a control plane is made, as a communicator would make one, for the
    topology and the agreement the probes and the report see.
    """
    control = ControlPlane(env.cpu_group, timeout_s)
    try:
        topo = control.topology(env.device.index if env.device.type == "cuda" else None)
        out = []
        for cfg in cfgs:
            ctx = BackendContext(cfg=cfg, group=None, control=control, topology=topo, rank=env.rank,
                                 world_size=env.world_size, device=env.device)
            out.append(local_availability(ctx))
        return out, control.agreement
    finally:
        control.close()


def agreed_reasons(env: RankEnv, cfgs: Sequence[EPConfig], timeout_s: float) -> list[dict[str, str]]:
    """Per config in ``cfgs``, ``merge_reasons`` over every rank: the same lists on every rank."""
    mine, _ = local_reasons(env, cfgs, timeout_s)
    everyone = gather_objects(env, mine)
    return [merge_reasons([rank_lists[i] for rank_lists in everyone]) for i in range(len(cfgs))]


def auto_pick(reasons: dict[str, str]) -> Optional[str]:
    """What ``backend="auto"`` picks first: the first backend of ``AUTO_ORDER`` every rank can run."""
    return next(iter(auto_candidates(reasons)), None)


def request_blocker(cfg: EPConfig, reasons: dict[str, str]) -> str:
    """Why ``cfg.backend`` (a backend's name or ``auto``, after ``$EP_COMM_BACKEND``) cannot run on
    every rank, given ``agreed_reasons`` for ``cfg``; "" when it can."""
    try:
        requested = cfg.resolved_backend_request()
    except EPConfigError as exc:
        return str(exc)
    if requested != "auto":
        return reasons.get(requested, f"unknown backend {requested!r}")
    if auto_pick(reasons):
        return ""
    return "no backend usable on every rank: " + "; ".join(f"{n}: {reasons[n]}" for n in AUTO_ORDER if n in reasons)
