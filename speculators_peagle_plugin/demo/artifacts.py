"""What the demo's own stages write: the run directory's layout, the training prompts and
the two drafts the eval serves. Every file appears under its name only when complete."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..common.errors import UserError
from ..common.files import atomic_directory, atomic_write_text
from ..data.prompts import load_prompt_set, render_conversation
from ..model.model_card import CARD_FILE, read_card, write_model_card
from ..training.loop import build_training

__all__ = [
    "RunLayout",
    "has_weights",
    "link_draft",
    "prompt_length_cut",
    "save_atomically",
    "save_untrained_draft",
    "write_prompts",
]


class RunLayout:
    """Where each stage writes inside the run directory ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.prompts = self.root / "train_prompts.jsonl"
        self.data = self.root / "data"
        self.validation_prompts = self.root / "validation_prompts.jsonl"
        self.validation_data = self.root / "validation-data"
        self.train = self.root / "train"
        self.trained_draft = self.root / "trained-draft"
        self.untrained_draft = self.root / "untrained-draft"
        self.eval = self.root / "eval"


def has_weights(path: Path) -> bool:
    """A model directory (target or draft) whose rename into place completed."""
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def prompt_length_cut(max_prompt_tokens: int | None, target: Path, max_new_tokens: int):
    """``fit(conversation)`` for :func:`write_prompts`: None without a cap; else the
    conversation up to its last user turn whose prompt fits ``max_prompt_tokens``, or None
    when its first does not: a reply after a longer prompt would not fit the training rows.

    Generation answers every user turn in order, after the replies before it
    (``datagen.generation``), so a turn's prompt is its system and user turns so far in
    ``target``'s chat template, each earlier reply at its longest: rendered with empty
    replies, plus ``max_new_tokens`` per reply. Turns after the first that does not fit are
    cut (their prompts hold its). A one-turn conversation is kept when it renders to at most
    ``max_prompt_tokens``. Example: cap 400, 100 new tokens, turns whose prompts with empty
    replies render to 120 and 350 tokens -> the first turn only (350 + 100 > 400).
    """
    if max_prompt_tokens is None:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)

    def fit(conversation: list[dict]) -> list[dict] | None:
        asked, kept, replies = [], 0, 0
        for i, message in enumerate(conversation):
            if message["role"] == "system":
                asked.append(message)
            if message["role"] != "user":
                continue
            asked.append(message)
            length = len(render_conversation(tokenizer, asked)) + replies * max_new_tokens
            if length > max_prompt_tokens:
                break
            kept, replies = i + 1, replies + 1
            asked.append({"role": "assistant", "content": ""})  # the reply generation writes
        return conversation[:kept] or None

    return fit


def write_prompts(
    train_specs: tuple[str, ...], eval_specs: tuple[str, ...], path: Path, fit=None
) -> int:
    """Write the training conversations as ``{"messages": [...]}`` rows; returns the count.

    Uses the eval harness's loader, so training and held-out prompts are rendered alike
    (HumanEval as "Complete the following Python function." + the prompt's code). Raises
    ``ValueError`` if an eval conversation is also a training one (it would not be held out).
    ``fit(conversation) -> conversation | None``, if given, is written in each one's place
    (None: left out), e.g. :func:`prompt_length_cut`'s.
    Example: ("humaneval[0:120]", "chat[0:100]") -> 220 rows.
    """
    rows = [c for spec in train_specs for c in load_prompt_set(spec).conversations]
    if fit is not None:
        rows = [c for c in map(fit, rows) if c is not None]
    seen = {json.dumps(c, sort_keys=True) for c in rows}
    for spec in eval_specs:
        held_out = load_prompt_set(spec).conversations
        shared = sum(json.dumps(c, sort_keys=True) in seen for c in held_out)
        if shared:
            raise UserError(
                f"{shared} conversation(s) of the eval set {spec!r} are also training prompts; "
                "eval prompts must be held out."
            )
    text = "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in rows)
    atomic_write_text(path, text)
    return len(rows)


def save_untrained_draft(train_config, output: Path) -> None:
    """The draft ``train`` starts from (same builder, same seed), saved without training."""
    save_atomically(build_training(train_config).draft, output)


def save_atomically(model, output: Path) -> None:
    """``model.save_pretrained(output)``, appearing under ``output`` only when complete."""
    with atomic_directory(output) as tmp:
        model.save_pretrained(tmp)


def link_draft(checkpoint: Path, output: Path) -> None:
    """``output`` = the servable files of ``checkpoint`` (hard links; copies across devices).

    The training state stays behind: ``output`` is what ``vllm serve`` is pointed at.
    """
    with atomic_directory(output) as tmp:
        for src in checkpoint.iterdir():
            if src.is_file() and (src.suffix in (".json", ".safetensors") or src.name == CARD_FILE):
                try:
                    os.link(src, tmp / src.name)
                except OSError:
                    shutil.copy2(src, tmp / src.name)
        if read_card(tmp) is not None:  # a new file (not the link): the serve line names output
            write_model_card(tmp, location=output)
