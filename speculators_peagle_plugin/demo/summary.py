"""The demo's closing report: ``RUN/demo.json`` and the lines printed after the eval."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from ..common.files import atomic_write_text
from ..evaluation.recommend import format_recommendation
from ..evaluation.report import format_table
from .artifacts import RunLayout
from .demo_config import DemoConfig
from .stages import Stages

__all__ = ["BUDGET_S", "SUMMARY_FILE", "acceptance_by_set", "summarise"]

SUMMARY_FILE = "demo.json"
BUDGET_S = 30 * 60


def acceptance_by_set(record: dict) -> dict[str, dict[str, dict]]:
    """The trained draft's acceptance per prompt set and K, from the cell at the largest
    concurrency (the one that decodes the whole held-out set): ``{set: {"K=4": {...}}}``."""
    out: dict[str, dict[str, dict]] = {}
    for r in record["runs"]:
        if r["label"] != "trained-draft" or not r["k"]:
            continue
        cell = out.setdefault(r["prompt_set"], {}).get(f"K={r['k']}")
        if cell is None or r["concurrency"] > cell["concurrency"]:
            out[r["prompt_set"]][f"K={r['k']}"] = {
                "concurrency": r["concurrency"],
                "acceptance_length": r["acceptance_length"],
                "per_position": r["per_position"],
                "per_category": r.get("per_category"),
            }
    return out


def summarise(config: DemoConfig, stages: Stages, outputs: dict, checkpoint: str,
              wall_s: float, echo: Callable[[str], None]) -> dict:
    """Write ``RUN/demo.json`` from the eval's record and the stage times; print the table,
    the K to serve per concurrency and the times; returns the summary."""
    record = json.loads(Path(outputs["record"]).read_text())
    seconds = stages.seconds()
    total = sum(seconds.values())
    summary = {
        "config": config.to_dict(),
        "stage_seconds": seconds,
        "pipeline_seconds": total,
        "this_invocation_seconds": wall_s,
        "checkpoint": checkpoint,
        "record": outputs["record"],
        "plots": outputs["plots"],
        "acceptance": acceptance_by_set(record),
        "recommendation": record.get("recommendation", []),
    }
    run_dir = Path(config.run_dir)
    atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
    echo("")
    echo(format_table(record["runs"]))
    if summary["recommendation"]:
        echo(format_recommendation(summary["recommendation"]))
    echo("")
    echo("stage seconds: " + ", ".join(f"{n} {s:.0f}" for n, s in seconds.items())
         + f"; pipeline {total:.0f} s (budget {BUDGET_S} s)")
    if config.quick:
        echo("quick mode: a pipeline check on a few prompts; the figures mean nothing.")
    echo(f"run directory: {run_dir.resolve()}")
    echo(f"  draft (serve this): {RunLayout(run_dir).trained_draft}  (checkpoint {checkpoint})")
    echo(f"  record: {outputs['record']}  plots: {', '.join(outputs['plots'])}  summary: "
         f"{run_dir / SUMMARY_FILE}")
    return summary
