"""The scaling curve's results (``eval/scaling.py``): points summarised over seeds, the
markdown tables for eval/RESULTS.md and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path

from speculators_peagle_plugin.common.files import atomic_write

EVAL_K = 4  # the K every point is served at
ESTIMATE = "held-out estimate"


# ----------------------------------------------------------------------------- results


def figures(point: dict) -> dict[str, float]:
    """A point's acceptance lengths by where they come from."""
    out = {f"served {s}": v["acceptance_length"] for s, v in point["served"].items()}
    out[ESTIMATE] = point["heldout"]["acceptance_length"]
    return out


def summarise(points: list[dict]) -> dict[tuple[int, int, int], dict[str, dict]]:
    """Per (prompts, layers, step) and figure: mean, sample std (0 for one seed), count."""
    groups: dict[tuple[int, int, int], list[dict]] = {}
    for p in points:
        groups.setdefault((p["prompts"], p["layers"], p["step"]), []).append(figures(p))
    out = {}
    for key, rows in sorted(groups.items()):
        names = [n for n in rows[0] if all(r.get(n) is not None for r in rows)]
        values = {n: [r[n] for r in rows] for n in names}
        out[key] = {n: {"mean": statistics.fmean(v),
                        "std": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}
                    for n, v in values.items()}
    return out


def _figure_names(summary: dict) -> list[str]:
    names = {n for figs in summary.values() for n in figs}
    return sorted(names - {ESTIMATE}) + [ESTIMATE]


def tables(summary: dict) -> str:
    """Markdown, one table per figure: a row per prompts x layers, a column per step;
    ``mean ± std (n)`` where several seeds were measured."""
    steps = sorted({s for _, _, s in summary})
    rows = sorted({(n, layers) for n, layers, _ in summary})
    text = []
    for name in _figure_names(summary):
        text += [f"**{name}** (acceptance length, K={EVAL_K})", "",
                 "| prompts × layers | " + " | ".join(map(str, steps)) + " |",
                 "|---|" + "---:|" * len(steps)]
        for n, layers in rows:
            cells = []
            for step in steps:
                s = summary.get((n, layers, step), {}).get(name)
                if s is None:
                    cells.append("-")
                elif s["n"] > 1:
                    cells.append(f"{s['mean']:.3f} ± {s['std']:.3f} ({s['n']})")
                else:
                    cells.append(f"{s['mean']:.3f}")
            text.append(f"| {n} × {layers} | " + " | ".join(cells) + " |")
        text.append("")
    return "\n".join(text)


def plot(summary: dict, path: Path) -> Path:
    """Acceptance length against steps: a panel per figure, a colour per prompts count, a
    line style per draft depth, error bars of the std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _figure_names(summary)
    counts = sorted({n for n, _, _ in summary})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for n, layers in sorted({(n, layers) for n, layers, _ in summary}):
            line = [(s, f[name]) for (pn, pl, s), f in sorted(summary.items())
                    if (pn, pl) == (n, layers) and name in f]
            if not line:
                continue
            ax.errorbar([s for s, _ in line], [f["mean"] for _, f in line],
                        yerr=[f["std"] for _, f in line], marker="o", capsize=3,
                        color=f"C{counts.index(n)}", linestyle=styles[(layers - 1) % 4],
                        label=f"{n} prompts, {layers} layer{'s' * (layers > 1)}")
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("optimizer steps")
        ax.set_ylabel(f"acceptance length (K={EVAL_K})")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path
