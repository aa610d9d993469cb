"""The demo's closing report: ``RUN/demo.json`` and the lines printed after the eval."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from ..common.files import atomic_write_text
from .artifacts import RunLayout
from .config import DemoConfig
from .stages import Stages

__all__ = ["BUDGET_S", "SUMMARY_FILE", "goal_run", "summarise"]

SUMMARY_FILE = "demo.json"
BUDGET_S = 30 * 60


def goal_run(record: dict, config: DemoConfig) -> dict | None:
    """The eval run the quality goal is about: trained draft, first eval set, largest K."""
    runs = [
        r for r in record["runs"]
        if r["label"] == "trained-draft" and r["prompt_set"] == config.eval_prompts[0]
    ]  # fmt: skip
    return max(runs, key=lambda r: r["k"]) if runs else None


def summarise(config: DemoConfig, stages: Stages, outputs: dict, checkpoint: str,
              wall_s: float, echo: Callable[[str], None]) -> dict:  # fmt: skip
    """Write ``RUN/demo.json`` from the eval's record and the stage times, print the
    acceptance table, the times and the goal's verdict; returns the summary."""
    from ..evaluation.report import format_table

    record = json.loads(Path(outputs["record"]).read_text())
    seconds = stages.seconds()
    total = sum(seconds.values())
    run = goal_run(record, config)
    summary = {
        "config": dataclasses.asdict(config),
        "stage_seconds": seconds,
        "pipeline_seconds": total,
        "this_invocation_seconds": wall_s,
        "checkpoint": checkpoint,
        "record": outputs["record"],
        "plot": outputs["plot"],
        "goal": {
            "prompt_set": config.eval_prompts[0],
            "k": run["k"] if run else None,
            "acceptance_length": run["acceptance_length"] if run else None,
            "per_position": run["per_position"] if run else None,
            "target": config.goal,
            "met": bool(run and run["acceptance_length"] >= config.goal),
        },
    }
    run_dir = Path(config.run_dir)
    atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
    echo("")
    echo(format_table(record["runs"]))
    echo("")
    echo("stage seconds: " + ", ".join(f"{n} {s:.0f}" for n, s in seconds.items())
         + f"; pipeline {total:.0f} s (budget {BUDGET_S} s)")  # fmt: skip
    if config.quick:
        echo("quick mode: a pipeline check on a few prompts; the figures mean nothing.")
    elif run is not None:
        verdict = "met" if summary["goal"]["met"] else "NOT met"
        per_pos = " / ".join(f"{p:.2f}" for p in run["per_position"])
        echo(f"quality goal (acceptance length >= {config.goal} at K={run['k']} on "
             f"{config.eval_prompts[0]}): {run['acceptance_length']:.3f} ({per_pos}) -> "
             f"{verdict}")  # fmt: skip
    echo(f"run directory: {run_dir.resolve()}")
    echo(f"  draft (serve this): {RunLayout(run_dir).trained_draft}  (checkpoint {checkpoint})")
    echo(f"  record: {outputs['record']}  plot: {outputs['plot']}  summary: "
         f"{run_dir / SUMMARY_FILE}")  # fmt: skip
    return summary
