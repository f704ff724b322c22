"""What tells a rank that a peer of its control plane is gone, without asking the peer.

Two sources: ``/proc`` (``liveness.process_gone``: same machine only) and the close markers that ranks
leave in the plane's store when they close their end or leave after a failure (``left/<rank>``: why,
the global ranks they lost, whether they aborted their NCCL groups), counted under ``MARKER_COUNT`` so
that a watcher learns of a new one with one store read.  Ranks that share a host also leave a copy in
their shared-memory file (``shm_agree``), which still answers when the store's host is the rank lost.
``ControlPlane`` reads them; this module turns them into verdicts.
"""
from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

import torch.distributed as dist

MARKER_COUNT = "left_count"

#: ``(reason, plane ranks it lost, whether it aborted its NCCL groups)``
Marker = tuple[str, list[int], bool]
#: ``(gone, followers, dead)``: see ``classify``
Verdict = tuple[dict[int, str], dict[int, list[int]], set[int]]


def encode_marker(reason: str, because_of: Sequence[int], aborted: bool) -> str:
    """A close marker: ``because_of`` in global ranks (peers' planes may rank them differently)."""
    return json.dumps({"reason": reason[:300], "because_of": list(because_of), "aborted": aborted})


def decode_marker(raw: str, global_ranks: Sequence[int]) -> Marker:
    """A close marker as a plane ranked by ``global_ranks`` reads it (a foreign string is its own reason)."""
    try:
        marker = json.loads(raw)
        blamed = [list(global_ranks).index(g) for g in marker.get("because_of", []) if g in global_ranks]
        return str(marker.get("reason", "")), blamed, bool(marker.get("aborted"))
    except (ValueError, AttributeError):
        return raw, [], False


def classify(exited: dict[int, str], markers: dict[int, Marker], rank: int, labels: Sequence[int]) -> Verdict:
    """``(gone, followers, dead)`` from the peers whose process exited (``{rank: why}``) and the close
    markers (``{rank: marker}``), in plane ranks.

    ``gone``: ``{rank: why}`` for peers gone on their own account (process exited, closed the plane for
    a reason of their own, or named as lost by a peer that left); ``followers``: ``{rank: [ranks it
    lost]}`` for peers that closed the plane because they lost others, even once their process has
    exited or another follower (which saw that exit before the marker) blames them: exiting is what a
    follower does next, no loss of its own; ``dead``: the ranks of ``gone`` that can no longer finish an NCCL
    collective with this rank (process exited, named as lost, or left after aborting its NCCL groups).
    A peer that merely closed its end drained its device first, so what it had queued with this rank
    completes: it is gone but not dead.  An exited peer whose marker blames only this rank (which it
    took for lost while this rank was merely slow) is gone.
    """
    gone, dead = dict(exited), set(exited)
    followers: dict[int, list[int]] = {}
    for r, (reason, blamed, aborted) in markers.items():
        if r in exited and not any(b != rank for b in blamed):
            continue
        if blamed:
            followers[r] = blamed
            gone.pop(r, None)
            dead.discard(r)
        else:
            gone[r] = f"it closed its end of the communicator: {reason}"
            if aborted:
                dead.add(r)
    for r, blamed in followers.items():
        for b in blamed:  # a peer on another machine may have seen what we cannot
            if b != rank and b not in gone and b not in followers:
                gone[b] = f"rank {labels[r]} lost it"
                dead.add(b)
    return gone, followers, dead


def _clone_of_tcp_store(store: dist.Store) -> Optional[dist.Store]:
    """A connection of its own to ``store`` when it is (a prefix of) a ``TCPStore``, else None.  A clone of
    a ``FileStore`` would count as one more member in the file's clean-up (each one destroyed counts,
    and the count reaching the members removes the file under the others), and a ``FileStore`` is only
    met by ranks on one host, where ``/proc`` answers anyway."""
    leaf: Optional[dist.Store] = store
    while isinstance(leaf, dist.PrefixStore):
        leaf = getattr(leaf, "underlying_store", None)  # unknown underneath: treated as no TCPStore
    if not isinstance(leaf, dist.TCPStore):
        return None
    try:
        return store.clone()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a torch without Store.clone(): the /proc evidence only
        return None


def loss_check(diagnose: Callable[[bool, Optional[dist.Store]], Verdict], store: dist.Store,
               labels: Sequence[int], store_every: int = 1) -> Callable[[], Optional[str]]:
    """What a watcher of NCCL groups asks: why this rank's NCCL collectives can no longer finish, or None.

    ``diagnose(use_store, store)``: the plane's verdict.  ``/proc`` is read on every call; the marker
    count on every ``store_every``-th (one round trip to the store's host, which serves every rank),
    through a connection of the watcher's own (a clone of ``store``: the plane's may be busy waiting
    for a long time), and the markers only once that count has changed; only a ``TCPStore`` is read.
    """
    own = _clone_of_tcp_store(store)
    seen, calls = [0], [0]

    def check() -> Optional[str]:
        nonlocal own
        gone, _, dead = diagnose(False, None)
        calls[0] += 1
        if not dead and own is not None and calls[0] % store_every == 0:
            try:
                count = own.add(MARKER_COUNT, 0)
            except Exception:  # noqa: BLE001 - its host may be the rank that died: stop asking it
                own = None
                return None
            if count != seen[0]:
                seen[0] = count
                gone, _, dead = diagnose(True, own)
        return "; ".join(f"rank {labels[r]} is gone ({gone[r]})" for r in sorted(dead)) or None
    return check
