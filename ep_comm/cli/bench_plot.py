"""``ep-comm bench --plot``: p50 latency against tokens per rank (needs matplotlib, the ``plot`` extra)."""
from __future__ import annotations

from typing import Any, Optional

#: how to get matplotlib, named wherever ``--plot`` finds it missing
INSTALL_HINT = "pip install 'ep-comm[plot]' (or pip install matplotlib)"


def matplotlib_problem() -> Optional[str]:
    """Why ``--plot`` cannot draw here (None when it can): asked before any rank starts, so that a run
    never ends without the PNG it was asked for."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"--plot needs matplotlib, which cannot be imported here ({exc}); install it: {INSTALL_HINT}"
    return None


def title(doc: dict) -> str:
    """The plot's title: device and world size, then the shape (hidden, top-k of experts, dtype, quant,
    tokens per rank) and the mode, from the bench document and its rows."""
    rows = doc["results"]
    first = rows[0] if rows else {}
    tokens = ", ".join(str(t) for t in sorted({r["tokens"] for r in rows})) or "-"
    dtype = str(first.get("dtype", "-"))
    if doc.get("quant") not in (None, "none"):
        dtype += f", {doc['quant']} dispatch"
    return (f"ep-comm bench: {doc['device']}, world size {doc['world_size']}, {doc.get('mode', '-')} mode\n"
            f"hidden {first.get('hidden', '-')}, top-{first.get('top_k', '-')} of {first.get('experts', '-')} "
            f"experts, {dtype}, tokens per rank {tokens}")


def figure(doc: dict) -> Any:
    """The figure of ``doc``'s rows: p50 latency vs tokens, one panel per op, one line per
    backend/layout, the same run's all_to_all_single baseline dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display on cluster nodes
    import matplotlib.pyplot as plt

    results = doc["results"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True)
    for ax, op in zip(axes, ("dispatch", "combine")):
        series: dict[str, list[tuple[int, float]]] = {}
        base: dict[int, float] = {}
        for r in results:
            if r["op"] == op:
                series.setdefault(f"{r['backend']}/{r['layout']}", []).append((r["tokens"], r["p50_us"]))
                base[r["tokens"]] = r["baseline_nccl_us"]
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        xs = sorted(base)
        ax.plot(xs, [base[x] for x in xs], "k--", marker="x", label=f"{doc['baseline_backend']} all_to_all_single")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("p50 latency (µs, max over ranks)")
    axes[1].legend(fontsize=8)
    fig.suptitle(title(doc), fontsize=10)
    fig.tight_layout()
    return fig


def plot(doc: dict, path: str) -> str:
    """Write the PNG of ``doc`` (the bench document) to ``path``; one line saying what happened."""
    problem = matplotlib_problem()
    if problem:
        return f"{problem}; {path} not written"
    if not doc["results"]:
        return f"--plot: no results to plot; {path} not written"
    import matplotlib.pyplot as plt

    fig = figure(doc)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
