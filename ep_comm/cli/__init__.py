"""The ``ep-comm`` command line (``ep_comm.cli.main:main``; also ``python -m ep_comm``).

Subcommands live in ``info``, ``bench`` and ``stress``; ``launcher`` starts their ranks.  This module
holds the small helpers they share: backend-list parsing, plain-text tables, the fields of a dispatch.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

import torch

from ..config import BACKEND_ENV

#: --dtype spellings of the CLI (EPConfig accepts more; the CLI keeps to the short names)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def written_to_input_buffer(comm, x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into ``comm.dispatch_input_buffer()`` (as an engine's previous layer would write it)
    and that buffer's first rows returned, for dispatch to take in place; ``x`` itself when it is not
    of ``cfg.dtype`` (an opaque payload)."""
    if x.dtype != comm.cfg.dtype:
        return x
    rows = comm.dispatch_input_buffer()[: x.shape[0]]
    rows.copy_(x)
    return rows


def default_backends(values: Optional[Sequence[str]]) -> list[str]:
    """``--backend`` as given, else ``auto`` when ``$EP_COMM_BACKEND`` picks one, else ``all``.

    The variable only overrides ``backend="auto"`` (docs/design.md §12); defaulting to ``auto`` when it is set
    makes ``EP_COMM_BACKEND=nvshmem ep-comm bench`` (or a launch script) time just that backend.
    """
    if values:
        return list(values)
    return ["auto"] if os.environ.get(BACKEND_ENV, "").strip() else ["all"]


def split_backends(values: Optional[Sequence[str]]) -> list[str]:
    """``["naive,ag_rs", "auto"]`` → ``["naive", "ag_rs", "auto"]`` (order kept, duplicates dropped)."""
    out: list[str] = []
    for value in values or ["all"]:
        for name in value.replace(",", " ").split():
            if name not in out:
                out.append(name)
    return out or ["all"]


def resolve_backend_request(values: Optional[Sequence[str]]) -> tuple[list[str], bool, Optional[str]]:
    """Turn ``--backend`` into ``(names, explicit, error)``.

    ``all`` means every registered backend.  ``explicit`` is False for ``all``: an unusable backend is
    then skipped with a note instead of failing the run.
    """
    from ..backends import registered

    names = split_backends(values)
    known = set(registered()) | {"auto"}
    if "all" in names:
        extra = [n for n in names if n != "all"]
        unknown = [n for n in extra if n not in known]
        if unknown:
            return [], False, _unknown_message(unknown)
        return list(registered()) + [n for n in extra if n not in registered()], False, None
    unknown = [n for n in names if n not in known]
    if unknown:
        return [], True, _unknown_message(unknown)
    return names, True, None


def _unknown_message(unknown: Iterable[str]) -> str:
    from ..backends import registered

    parts = [f"unknown backend {name!r}" for name in unknown]
    choices = ", ".join(list(registered()) + ["auto", "all"])
    return "; ".join(parts) + f" (choose from: {choices})"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Iterable[int] = ()) -> str:
    """A plain-text table; columns listed in ``right`` are right-aligned (numbers)."""
    right = set(right)
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells[1:])
    return "\n".join(out)
