"""The evaluation's pictures, one PNG per figure (matplotlib, Agg), written atomically.

- ``acceptance.png``: per-position acceptance per prompt set (largest K), and with a K
  sweep the acceptance length against K;
- ``speedup.png``: tokens/s over no draft against concurrency, one line per K;
- ``training.png``: when a draft directory came from ``train`` (a ``metrics.jsonl`` in it
  or its parent), its loss, accuracy per depth and estimated acceptance length per step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from ..common.files import METRICS_FILE, atomic_write

__all__ = ["plot_acceptance", "plot_speedup", "plot_training", "training_metrics", "write_plots"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    _pyplot().close(fig)
    return path


def write_plots(record: dict, out_dir: Path) -> list[Path]:
    """Every figure the record supports; returns the files written."""
    runs = record["runs"]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if any(r["k"] for r in runs):
        written.append(plot_acceptance(runs, out_dir / "acceptance.png"))
    if any(r.get("speedup") for r in runs):
        written.append(plot_speedup(runs, out_dir / "speedup.png"))
    for i, draft in enumerate(record.get("drafts", [])):
        metrics = training_metrics(Path(draft["path"]))
        if metrics:
            name = "training.png" if i == 0 else f"training-{i}.png"
            written.append(plot_training(metrics, out_dir / name, Path(draft["path"]).name))
    return written


def _widest(runs: Sequence[dict]) -> dict[tuple[str, str, int], dict]:
    """Per (draft, prompt set, K) the cell at the largest concurrency (its whole set)."""
    cells: dict[tuple[str, str, int], dict] = {}
    for r in runs:
        if r["k"]:
            key = (r["label"], r["prompt_set"], r["k"])
            wider = key not in cells or r["concurrency"] > cells[key]["concurrency"]
            if wider:
                cells[key] = r
    return cells


def plot_acceptance(runs: Sequence[dict], path: Path) -> Path:
    """Per-position acceptance (bars, largest K) per draft and prompt set; with several K,
    the acceptance length against K."""
    plt = _pyplot()
    cells = _widest(runs)
    groups: dict[tuple[str, str], list[dict]] = {}
    for (label, prompts, _), r in sorted(cells.items()):
        groups.setdefault((label, prompts), []).append(r)
    sweep = any(len(g) > 1 for g in groups.values())
    fig, axes = plt.subplots(1, 1 + sweep, figsize=(5.5 * (1 + sweep), 4.2), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(groups)
    for j, ((label, prompts), group) in enumerate(groups.items()):
        top = max(group, key=lambda r: r["k"])
        xs = [i + 1 + (j - (len(groups) - 1) / 2) * width for i in range(top["k"])]
        ax.bar(xs, top["per_position"], width, label=f"{label} · {prompts} (K={top['k']})")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05))
    ax.set_xticks(range(1, max(k for *_, k in cells) + 1))
    ax.set_title("per-position acceptance")
    ax.legend(fontsize=7)
    if sweep:
        ax_len = axes[0][1]
        for (label, prompts), group in groups.items():
            ax_len.plot([r["k"] for r in group], [r["acceptance_length"] for r in group], "o-",
                        label=f"{label} · {prompts}")
        all_ks = sorted({k for *_, k in cells})
        ax_len.plot(all_ks, [k + 1 for k in all_ks], "k:", label="every draft accepted")
        ax_len.set(xlabel="K", ylabel="mean acceptance length", title="acceptance length vs K")
        ax_len.set_xticks(all_ks)
        ax_len.set_ylim(bottom=1.0)
        ax_len.legend(fontsize=7)
    return _save(fig, path)


def plot_speedup(runs: Sequence[dict], path: Path) -> Path:
    """Speedup over no draft against requests in flight, one line per (draft, prompt set, K)."""
    plt = _pyplot()
    lines: dict[tuple[str, str, int], list[dict]] = {}
    for r in runs:
        if r["k"] and r.get("speedup"):
            lines.setdefault((r["label"], r["prompt_set"], r["k"]), []).append(r)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (label, prompts, k), cells in sorted(lines.items()):
        cells = sorted(cells, key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in cells], [r["speedup"] or math.nan for r in cells],
                "o-", label=f"{label} · {prompts} · K={k}")
    concurrencies = sorted({r["concurrency"] for cells in lines.values() for r in cells})
    ax.axhline(1.0, color="k", ls=":", label="no draft")
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.set(xlabel="requests in flight", ylabel="output tokens/s vs no draft",
           title="speedup vs concurrency")
    ax.legend(fontsize=7)
    return _save(fig, path)


def training_metrics(draft: Path) -> list[dict]:
    """The step records of the ``train`` run that wrote ``draft`` ([] when there is none)."""
    for folder in (draft, draft.parent):
        path = folder / METRICS_FILE
        if path.is_file():
            lines = path.read_text().splitlines()
            return [json.loads(line) for line in lines if line.strip()]
    return []


def plot_training(metrics: Sequence[dict], path: Path, title: str) -> Path:
    """Loss, accuracy per depth and the estimated acceptance length against the step."""
    plt = _pyplot()
    steps = [m["step"] for m in metrics]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    axes[0].plot(steps, [m["loss"] for m in metrics])
    axes[0].set(xlabel="step", ylabel="loss", title=f"{title}: training loss")
    depths = max(len(m.get("accuracy_per_depth") or []) for m in metrics)
    for d in range(depths):
        accuracy = [_at(m.get("accuracy_per_depth"), d) for m in metrics]
        axes[1].plot(steps, accuracy, label=f"depth {d}")
    axes[1].set(xlabel="step", ylabel="argmax accuracy", title="accuracy per depth", ylim=(0, 1))
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [m.get("acceptance_length", math.nan) for m in metrics])
    axes[2].set(xlabel="step", ylabel="estimated acceptance length",
                title="acceptance length estimate")
    return _save(fig, path)


def _at(values: Sequence[float] | None, i: int) -> float:
    return values[i] if values and i < len(values) else math.nan
