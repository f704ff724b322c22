"""Streaming output of ``ep-comm bench``: one table line per measured op, the JSON rewritten per row.

A benchmark that is stopped (timeout, Ctrl-C, a lost machine) must keep what it measured, so rank 0
prints every row as soon as the ranks have agreed on its numbers and rewrites the whole ``--json``
document right before printing it (write to a temporary file, then rename: a reader never sees a
half-written file).  ``"complete": false`` marks a document whose run has not finished.
The table has fixed column widths, so rows can be printed before the widest value is known.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from typing import Any, Callable, Optional, Sequence

import torch

from .launcher import RankEnv
from .phases import format_phases


def device_name(env: RankEnv) -> str:
    if env.device.type == "cuda":
        return torch.cuda.get_device_name(env.device)
    return f"cpu ({platform.machine() or 'unknown'}, gloo)"


#: prefixes of the environment variables a result depends on: ep_comm's switches (kernel forms, SMs), NCCL's
#: and NVSHMEM's (the baseline and the nvshmem backend) and torch's symmetric memory
SETTINGS_PREFIXES = ("EP_COMM_", "NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_")


def settings_environment() -> dict[str, str]:
    """The variables of SETTINGS_PREFIXES set in this process (rank 0's), sorted by name: what an A/B of
    a switch ($EP_COMM_COMBINE_GROUPED, say) changed, recorded with its numbers."""
    return {k: os.environ[k] for k in sorted(os.environ) if k.startswith(SETTINGS_PREFIXES)}


def git_commit() -> tuple[str, Optional[bool]]:
    """Commit of the checkout ep_comm runs from (and whether tracked files differ from it).
    ``EP_COMM_GIT_COMMIT``, when set, is taken as given (dirty unknown): a copy of a tree whose git
    metadata is not that of its files (a machine that receives the working tree) would report a stale
    commit."""
    given = os.environ.get("EP_COMM_GIT_COMMIT")
    if given:
        return given, None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode:
            return "unknown", None
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "unknown", None


def _num(fmt: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else format(v, fmt)


#: one table column: (header, width, right-aligned, the row's key, formatter)
Column = tuple[str, int, bool, str, Callable[[Any], str]]


def table_columns(gpu: bool, mode: str, recv_hook: bool, with_peer: bool, baseline_backend: str,
                  variants: bool = False) -> list[Column]:
    """The table's columns.  GPU-only ones appear on GPU ranks only: ``GB/s`` (the bandwidth a GPU
    transport reaches; over gloo it measures the host's copies), ``SMs`` (what a kernel backend
    occupies) and, in eager mode, ``host_us`` (the host's own time per call, which on CPUs already is
    the p50).  The JSON keeps every key either way.  ``variants`` (``--env``): a column of the
    variable's value each row ran with.

    Widths fit the usual values; a wider value shifts its line instead of delaying the table.
    """
    cols: list[Column] = [
        ("backend", 7, False, "backend", str),
        *([("variant", 8, False, "variant", lambda v: "unset" if v is None else str(v))] if variants else []),
        ("layout", 10 if with_peer else 8, False, "layout", str),
        ("op", 13 if recv_hook else 8, False, "op", str),  # 13 fits the halves' names ("dispatch_send")
        ("tokens", 6, True, "tokens", str), ("p50_us", 8, True, "p50_us", _num(".1f")),
        ("p90_us", 8, True, "p90_us", _num(".1f")),
    ]
    if gpu:
        if mode == "eager":
            cols.append(("host_us", 7, True, "host_p50_us", _num(".1f")))
        cols += [("GB/s", 7, True, "gbps", _num(".3g")), ("SMs", 3, True, "sms", _num("d"))]
    cols += [(f"{baseline_backend}_a2a_us", 11, True, "baseline_nccl_us", _num(".1f")),
             ("ratio", 5, True, "ratio", _num(".2f"))]
    if with_peer:
        cols += [("peer", 17, False, "peer", lambda v: "-" if v is None else str(v)),
                 ("peer_p50_us", 11, True, "peer_p50_us", _num(".1f")),
                 ("vs_peer", 7, True, "vs_peer", _num(".2f"))]
    return cols


class Reporter:
    """Rank 0's table and JSON; on other ranks every method is a no-op."""

    def __init__(self, env: RankEnv, args: argparse.Namespace, baseline_backend: str, with_peer: bool,
                 on_write: Optional[Callable[[dict], None]] = None):
        self.active = env.is_root
        self.args = args
        self.on_write = on_write  # tests: called with the document after every rewrite
        recv_hook = bool(getattr(args, "recv_hook", False))
        variant_of = getattr(args, "env_name", None)
        self.columns = table_columns(env.device.type == "cuda", args.mode, recv_hook, with_peer, baseline_backend,
                                     variants=variant_of is not None)
        self.results: list[dict] = []
        self.peers: list[dict] = []
        self.failures: list[dict] = []
        self.notes: list[str] = []
        self.doc: dict = {}
        self._header_printed = False
        if self.active:
            commit, dirty = git_commit()
            self.doc = {
                "device": device_name(env), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "git_commit": commit, "world_size": env.world_size, "results": self.results,
                "git_dirty": dirty, "device_count": torch.cuda.device_count() if env.device.type == "cuda" else 0,
                "hosts": env.topology.num_hosts, "mode": args.mode, "routing": args.routing, "quant": args.quant,
                "validate_ids": getattr(args, "validate_ids", "on"), "recv_hook": recv_hook,
                "zero_copy": bool(getattr(args, "zero_copy", False)),
                "dispatch_input": getattr(args, "dispatch_input", "buffer"),
                # how eager calls were issued to the GPU (None: graph mode, or CPU ranks, where it means nothing)
                "eager_launch": (getattr(args, "eager_launch", "queued")
                                 if args.mode == "eager" and env.device.type == "cuda" else None),
                "iters": args.iters, "warmup": args.warmup, "sets": args.sets, "baseline_backend": baseline_backend,
                "torch": torch.__version__, "launcher": env.launcher, "failures": self.failures,
                "environment": settings_environment(),
                # --env: every row's "variant" is this variable's value for it (None: unset)
                "variant_of": variant_of,
                "peers": self.peers, "notes": self.notes, "phase_times_s": {}, "complete": False,
            }

    # -- table --------------------------------------------------------------------------------------------
    def _line(self, cells: Sequence[str]) -> str:
        out = [c.rjust(w) if right else c.ljust(w) for c, (_, w, right, _, _) in zip(cells, self.columns)]
        return "  ".join(out).rstrip()

    def _print_header(self) -> None:
        if not self._header_printed:
            self._header_printed = True
            self.columns = [(h, max(w, len(h)), r, k, f) for h, w, r, k, f in self.columns]
            print(self._line([c[0] for c in self.columns]), flush=True)
            print("  ".join("-" * c[1] for c in self.columns), flush=True)

    def _print_rows(self, rows: Sequence[dict]) -> None:
        self._print_header()
        for r in rows:
            print(self._line([fmt(r.get(key)) for _, _, _, key, fmt in self.columns]), flush=True)

    # -- events ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """The table header and an empty document, so even a run stopped before its first row leaves both."""
        if self.active:
            self._print_header()
            self._write()

    def rows(self, rows: Sequence[dict], phase_totals: Optional[dict] = None) -> None:
        """Our measured rows: into the JSON first, then onto stdout (so a printed row is always saved)."""
        if not self.active:
            return
        self.results.extend(rows)
        if phase_totals is not None:
            self.doc["phase_times_s"] = phase_totals
        self._write()
        self._print_rows(rows)

    def peer_rows(self, rows: Sequence[dict]) -> None:
        if not self.active or not rows:
            return
        self.peers.extend(rows)
        self._write()
        self._print_rows(rows)

    def failure(self, backend: str, layout: str, tokens: int, problems: list[str], stage: str = "oracle check",
                variant: Optional[str] = None) -> None:
        """A config that failed at ``stage`` (its oracle check, or its creation) and was not timed."""
        if not self.active:
            return
        self.failures.append({"backend": backend, "layout": layout, "tokens": tokens, "problems": problems,
                              "variant": variant})
        self._write()
        which = "" if self.doc.get("variant_of") is None else f", ${self.doc['variant_of']}={variant or '(unset)'}"
        print(f"FAILED {stage}: backend {backend}, layout {layout}, tokens {tokens}{which}; not timed", flush=True)
        for p in problems[:10]:
            print(f"  {p}", flush=True)

    def unusable(self, backend: str, reason: str) -> None:
        """A backend asked for by name that cannot run on every rank: one failure of the run, said once
        (``layout`` and ``tokens`` are null in its JSON record: it fails for all of them)."""
        if not self.active:
            return
        self.failures.append({"backend": backend, "layout": None, "tokens": None,
                              "problems": [f"cannot run on every rank here: {reason}"], "variant": None})
        self._write()
        print(f"FAILED: backend {backend} cannot run on every rank here ({reason}); not timed", flush=True)

    def note(self, text: str, now: bool = True) -> None:
        """A note for the end of the table (and the JSON); ``now``: also print it at once."""
        if not self.active or text in self.notes:
            return
        self.notes.append(text)
        self._write()
        if now:
            print(text, flush=True)

    def finish(self, phase_totals: dict, show_phases: bool) -> None:
        if not self.active:
            return
        if not self.results and not self.failures:
            print("(no results)", flush=True)
        unusable = sum(1 for f in self.failures if f["tokens"] is None)
        if len(self.failures) > unusable:
            print(f"{len(self.failures) - unusable} config(s) FAILED and were not timed", flush=True)
        if unusable:
            print(f"{unusable} requested backend(s) cannot run here", flush=True)
        self.doc["phase_times_s"] = phase_totals
        self.doc["complete"] = True
        self._write()
        if show_phases:
            print(f"phase times (s, slowest rank): {format_phases(phase_totals)}", file=sys.stderr, flush=True)
        if self.args.json:
            print(f"wrote {self.args.json}", flush=True)
        if self.args.plot:
            from .bench_plot import plot

            print(plot(self.doc, self.args.plot), flush=True)

    def _write(self) -> None:
        if self.on_write is not None:
            self.on_write(self.doc)
        path = self.args.json
        if not path:
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(self.doc, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)  # atomic: the file is always a complete document
