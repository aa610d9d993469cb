"""The eval's part of a draft's model card: its entries and the acceptance table made of them.

A card keeps one entry per measured cell of its draft (``peagle_eval`` in its front matter,
:mod:`..model.model_card`), keyed by the prompt set and the settings that change the
figures: K, concurrency and the eval settings marked ``card=True`` (dtype, max new tokens,
...). An eval merges its entries into the card's (:func:`merge_entries`): an entry of the same
key is replaced unless it was measured on more prompts, so a smoke test never displaces the
full table; entries of other keys stay. The acceptance section is the table of all entries,
each row with its prompt count, and the command, versions and machine that measured it.
A draft without a card of ours is left as it is.

Example: the card holds humaneval K=4 on 164 prompts; an eval of humaneval[:2] adds a row of
its own (another prompt set), and one of the first 2 prompts at the same settings (via
``--prompts-per-slot``) leaves the 164-prompt row in place.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..common.paths import writing
from ..common.settings import leaves
from ..model.model_card import CARD_FILE, EVALS, portable_path, read_card, write_eval_section
from .eval_config import EvalConfig

__all__ = ["card_entries", "eval_section", "merge_entries", "update_model_cards"]


def _card_settings() -> tuple[str, ...]:
    """The eval settings that key a card entry (besides K and concurrency)."""
    return tuple(leaf.key for leaf in leaves(EvalConfig) if leaf.field.metadata.get("card"))


def _command(argv: list[str]) -> str:
    """The command line with every absolute path as :func:`portable_path` names it."""
    shown = [Path(argv[0]).name] if argv else []
    for arg in argv[1:]:
        flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        shown.append(flag + eq + (portable_path(value) if value.startswith("/") else value))
    return shlex.join(shown)


def card_entries(record: dict, draft: str) -> list[dict]:
    """One card entry per drafted cell of ``draft`` (as named in ``record["drafts"]``)."""
    where = Path(draft).resolve()
    baseline = {(r["prompt_set"], r.get("concurrency")): r for r in record["runs"] if not r["k"]}
    card_settings = {key: record["config"].get(key) for key in _card_settings()}
    entries = []
    for r in record["runs"]:
        if not r["k"] or r["draft"] is None or Path(r["draft"]).resolve() != where:
            continue
        base = baseline.get((r["prompt_set"], r.get("concurrency"))) or {}
        entries.append({
            "prompts": portable_path(r["prompt_set"]),
            "settings": {"k": r["k"], "concurrency": r.get("concurrency"), **card_settings},
            "prompt_count": len(r["outputs"]),
            "acceptance_length": _round(r["acceptance_length"], 4),
            "per_position": [_round(p, 4) for p in r["per_position"] or []],
            "drafts": (r["counters"] or {}).get("num_drafts"),
            "tokens_per_s": _round(r["tokens_per_s"], 2),
            "no_draft_tokens_per_s": _round(base.get("tokens_per_s"), 2),
            "speedup": _round(r.get("speedup"), 4),
            "measured": _measured(record["provenance"]),
        })
    return entries


def _measured(prov: dict) -> dict:
    """When, where, with what and by which command a record was measured."""
    return {
        "utc": prov["created_utc"],
        "machine": prov["hardware"].get("gpu") or prov["hardware"].get("cpu") or "?",
        "versions": ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v),
        "command": _command(prov["argv"]),
    }


def _round(value, digits: int):
    return None if value is None else round(float(value), digits)


def _key(entry: dict) -> tuple:
    return entry["prompts"], tuple(sorted(entry["settings"].items()))


def merge_entries(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each of ``new`` in place of the entry of its key (or after them), unless
    that one was measured on more prompts."""
    merged = {_key(e): e for e in old}
    for entry in new:
        kept = merged.get(_key(entry))
        if kept is None or kept["prompt_count"] <= entry["prompt_count"]:
            merged[_key(entry)] = entry
    return list(merged.values())


def eval_section(entries: list[dict]) -> str:
    """The card's acceptance section: a table row per entry, then who measured each row."""
    names = list(dict.fromkeys(k for e in entries for k in e["settings"]))
    head = ["prompts", "n prompts", *names, "accept len", "per position", "drafts", "tok/s",
            "no-draft tok/s", "speedup", "measured"]
    runs = list(dict.fromkeys(map(_run_of, entries)))
    rows = []
    for e in entries:
        settings = [_cell(e["settings"].get(n)) for n in names]
        figures = [_cell(e["acceptance_length"], ".3f"),
                   " / ".join(f"{p:.2f}" for p in e["per_position"]) or "-", _cell(e["drafts"]),
                   _cell(e["tokens_per_s"], ".1f"), _cell(e["no_draft_tokens_per_s"], ".1f"),
                   _cell(e["speedup"], ".2f") + ("x" if e["speedup"] else "")]
        run = runs.index(_run_of(e)) + 1
        rows.append([e["prompts"], str(e["prompt_count"]), *settings, *figures, f"[{run}]"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("")
    for i, (utc, machine, versions, command) in enumerate(runs, 1):
        lines.append(f"- [{i}] {utc}, {machine}; {versions}: `{command}`")
    return "\n".join(lines)


def _run_of(entry: dict) -> tuple[str, str, str, str]:
    m = entry["measured"]
    return m["utc"], m["machine"], m["versions"], m["command"]


def _cell(value, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, spec)


def update_model_cards(record: dict, echo) -> None:
    """Merge this eval's entries into every evaluated draft's model card."""
    base_model = record["config"].get("base_model")
    for draft in record["drafts"]:
        card = read_card(draft["path"])
        if card is None:
            continue
        entries = merge_entries(card[0].get(EVALS) or [], card_entries(record, draft["path"]))
        if not entries:
            continue
        with writing(Path(draft["path"]) / CARD_FILE, "the draft's model card"):
            write_eval_section(draft["path"], eval_section(entries), entries, base_model)
        echo(f"model card: {Path(draft['path']) / CARD_FILE} (acceptance and speed)")
