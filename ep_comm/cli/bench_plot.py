"""``ep-comm bench --plot``: p50 latency against tokens per rank (needs matplotlib)."""
from __future__ import annotations


def plot(results: list[dict], path: str, baseline_backend: str) -> str:
    """p50 latency vs tokens, one panel per op, one line per backend/layout, baseline dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on cluster nodes
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install matplotlib); {path} not written"
    if not results:
        return f"--plot: no results to plot; {path} not written"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
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
        ax.plot(xs, [base[x] for x in xs], "k--", marker="x", label=f"{baseline_backend} all_to_all_single")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("tokens per rank")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("p50 latency (µs, max over ranks)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
