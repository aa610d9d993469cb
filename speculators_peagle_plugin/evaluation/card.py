"""The eval's part of a draft's model card: its acceptance and speed section.

When eval measures a draft that has a model card of ours (``serving.model_card``), the
card's acceptance section becomes this run's table (the draft's rows and the no-draft rows
they are compared with), its recommendation, and the command, versions and machine that
measured them. A draft without such a card is left as it is.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..serving.model_card import write_eval_section
from .recommend import format_recommendation
from .report import format_table

__all__ = ["eval_section", "update_model_cards"]


def eval_section(record: dict, draft: str) -> str:
    """The card text for ``draft`` (as named in ``record["drafts"]``) from a finished record."""
    where = Path(draft).resolve()
    mine = [r for r in record["runs"] if r["draft"] is None or Path(r["draft"]).resolve() == where]
    prov = record["provenance"]
    versions = ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v)
    machine = prov["hardware"].get("gpu") or prov["hardware"].get("cpu") or "?"
    lines = [
        f"Measured {prov['created_utc']} ({record['config']['dtype']}, {machine}; {versions}):",
        "",
        "```bash",
        shlex.join(prov["argv"]),
        "```",
        "",
        "```text",
        format_table(mine),
        "```",
    ]
    recommended = [r for r in record.get("recommendation") or [] if r["label"] in
                   {run["label"] for run in mine if run["draft"] is not None}]
    if recommended:
        lines += ["", "```text", format_recommendation(recommended), "```"]
    return "\n".join(lines)


def update_model_cards(record: dict, echo) -> None:
    """Write the acceptance section of every evaluated draft's model card."""
    for draft in record["drafts"]:
        if write_eval_section(draft["path"], eval_section(record, draft["path"])):
            echo(f"model card: {Path(draft['path']) / 'README.md'} (acceptance and speed)")
