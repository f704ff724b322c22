"""Wall-clock time per phase of a CLI run (``ep-comm bench --phase-times``).

A benchmark that users run first on a new cluster has to start quickly; to know where its wall time
goes at EP8 each rank accumulates host wall time per named phase (spawn, init, communicator
creation, oracle check, capture, warm-up, timing, baseline, ...).  Ranks are gathered with the rows
they belong to, so the report shows the slowest rank of each phase.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Mapping, Optional, Sequence

#: the order phases are printed in (unknown names follow, alphabetically)
ORDER = ("spawn", "init", "nccl_init", "peer_init", "inputs", "baseline", "peer", "create", "check", "warmup",
         "capture", "replay_check", "timing", "barrier", "close")


class Phases:
    """Accumulates ``{phase: seconds}`` on this rank; ``take()`` returns what accrued since the last take."""

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self._since: dict[str, float] = {}
        #: called with a phase's name when it starts (a run that hangs then shows where)
        self.on_start: Optional[Callable[[str], None]] = None

    def add(self, name: str, seconds: float) -> None:
        self.total[name] = self.total.get(name, 0.0) + seconds
        self._since[name] = self._since.get(name, 0.0) + seconds

    def started(self, name: str) -> None:
        """Announce a phase whose time is booked with ``add`` (not timed by the context manager)."""
        if self.on_start is not None:
            self.on_start(name)

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.started(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def take(self) -> dict[str, float]:
        out, self._since = self._since, {}
        return out


def max_over_ranks(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per phase, the slowest rank (what the run waited for), rounded to ms."""
    out: dict[str, float] = {}
    for ph in per_rank:
        for name, s in ph.items():
            out[name] = max(out.get(name, 0.0), s)
    return {k: round(out[k], 3) for k in sorted(out, key=_order_key)}


def merge(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Sum of two phase maps (a run's total from its rows)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = round(out.get(k, 0.0) + v, 3)
    return {k: out[k] for k in sorted(out, key=_order_key)}


def format_phases(phases: Mapping[str, float]) -> str:
    """``init 1.20s, create 0.31s, ...`` in run order."""
    return ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()) or "-"


def _order_key(name: str) -> tuple[int, str]:
    return (ORDER.index(name), "") if name in ORDER else (len(ORDER), name)
