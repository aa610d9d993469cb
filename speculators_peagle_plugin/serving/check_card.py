"""The model card rule of ``check``: a card (:mod:`..model.model_card`) that no longer
describes its checkpoint, or whose front matter is not plain YAML."""

from __future__ import annotations

import yaml

from ..model.model_card import card_facts, raw_card, read_card
from .draft_checkpoint import DraftCheckpoint, Finding, warning

__all__ = ["card_findings"]


def card_findings(ckpt: DraftCheckpoint) -> list[Finding]:
    """A card whose front matter is not plain YAML, or whose facts differ from the
    checkpoint's config.json (one finding per fact). The front matter is read with
    ``yaml.safe_load`` only: nothing in it is constructed or run."""
    raw = raw_card(ckpt.path)
    if raw is None:
        return []
    try:
        yaml.safe_load(raw[0])
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        return [warning(
            "model-card-yaml",
            f"README.md's front matter is not plain YAML ({problem}); a tool that loads it "
            "with Python tags allowed would construct the objects it names.",
            "Rewrite the front matter as plain YAML, or delete README.md.",
        )]
    card = read_card(ckpt.path)
    if card is None:
        return []
    stated = card[0]["peagle"]
    found = []
    for key, value in card_facts(ckpt.config).items():
        if key in stated and stated[key] != value:
            found.append(
                warning(
                    "model-card",
                    f"README.md's model card says {key}: {stated[key]!r} but config.json "
                    f"gives {value!r}.",
                    "export the draft (its copy's card is written from config.json), or train "
                    "or evaluate it again.",
                    mechanical=True,
                )
            )
    return found
