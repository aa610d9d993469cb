"""A trained draft's model card: ``README.md`` beside its ``config.json``.

What a user reads before serving or sharing a draft: the target it drafts for, the data and
recipe that made it, what it accepts and how fast (the eval's table with its command), and
the exact ``vllm serve`` line. The card is a model hub card: YAML front matter, then
markdown. The front matter's ``peagle`` block states the config facts that matter when
serving (K, layers, draft vocabulary, aux layers, mask token), so ``check`` can tell a card
that no longer describes its checkpoint (:func:`card_findings`).

Who writes what: ``train`` writes the card into every checkpoint it saves
(:func:`write_model_card`); ``eval`` replaces the card's acceptance section when it
evaluates that draft (:func:`write_eval_section`); ``export`` rewrites the facts of the
copy it fixes. A README.md without a ``peagle`` block is someone else's and is left alone.

Example::

    write_model_card("ckpt/checkpoint-1000", training={"steps": 1000, ...})
    card_findings(DraftCheckpoint.read("ckpt/checkpoint-1000"))   # [] while they agree
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from ..common.files import atomic_write_text
from ..common.reading import read_json
from .draft_checkpoint import DraftCheckpoint, Finding, declared_k, warning

__all__ = [
    "CARD_FILE",
    "card_facts",
    "card_findings",
    "read_card",
    "serve_command",
    "write_eval_section",
    "write_model_card",
]

CARD_FILE = "README.md"
EVAL_BEGIN, EVAL_END = "<!-- peagle-eval -->", "<!-- /peagle-eval -->"
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
# The recipe settings a card lists (TrainConfig names), when training states them.
RECIPE_KEYS = (
    "num_layers", "num_depths", "down_sample_ratio", "down_sample_ratio_min", "total_seq_len",
    "sequence_partitions", "lr", "epochs", "max_steps", "draft_init", "autocast", "seed",
)


def card_facts(config: dict) -> dict:
    """The facts of a draft's ``config.json`` that its card states, by card key."""
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    layer = config.get("transformer_layer_config") or {}
    return {
        "base_model": verifier.get("name_or_path"),
        "speculative_tokens": declared_k(config),
        "num_layers": layer.get("num_hidden_layers"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "mask_token_id": config.get("mask_token_id"),
    }


def serve_command(draft_dir: str | Path, config: dict) -> str:
    """The ``vllm serve`` line that serves ``draft_dir`` with parallel drafting."""
    facts = card_facts(config)
    spec = {"method": "eagle3", "model": str(draft_dir), "parallel_drafting": True,
            "num_speculative_tokens": facts["speculative_tokens"]}
    return f"vllm serve {facts['base_model']} --speculative-config '{json.dumps(spec)}'"


def read_card(draft_dir: str | Path) -> tuple[dict, str] | None:
    """``(front matter, body)`` of the draft's card, or None where it has no card of ours."""
    path = Path(draft_dir) / CARD_FILE
    if not path.is_file():
        return None
    text = path.read_text()
    match = _FRONT.match(text)
    if match is None:
        return None
    try:
        front = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return None
    if not isinstance(front, dict) or not isinstance(front.get("peagle"), dict):
        return None
    return front, text[match.end() :]


def _front_matter(config: dict) -> str:
    facts = card_facts(config)
    front = {
        "base_model": facts.pop("base_model"),
        "library_name": "vllm",
        "tags": ["speculative-decoding", "eagle3", "p-eagle", "speculators"],
        "peagle": facts,
    }
    return "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n"


def _made_rows(training: dict) -> list[tuple[str, str]]:
    rows = []
    data = training.get("data") or {}
    if data:
        guard = data.get("contamination") or {}
        d = data.get
        made = (
            (f"{training['samples']} samples: " if training.get("samples") else "")
            + f"the target's replies to `{d('prompts')}` "
            f"({d('num_samples')} per prompt, temperature {d('temperature')}, up to "
            f"{d('max_new_tokens')} new tokens, {d('backend')} in {d('dtype')})"
        )
        rows.append(("data", made))
        if guard:
            held = ", ".join(guard.get("held_out", []))
            rows.append(("held out", f"{guard.get('dropped')} prompts dropped that overlap {held}"))
    elif training.get("data_path"):
        rows.append(("data", f"`{training['data_path']}`"))
    recipe = training.get("recipe") or {}
    settings = ", ".join(f"{k}={recipe[k]}" for k in RECIPE_KEYS if recipe.get(k) is not None)
    if settings:
        rows.append(("recipe", settings))
    if training.get("steps") is not None:
        rows.append(("trained", f"{training['steps']} optimizer steps"))
    return rows


def write_model_card(
    draft_dir: str | Path, training: dict | None = None, *, location: str | Path | None = None
) -> Path:
    """Write (or rewrite) ``draft_dir/README.md`` from its ``config.json`` and ``training``.

    Args:
        draft_dir: a saved draft (its config.json is read).
        training: what made it, any of ``steps``, ``samples``, ``data`` (the data's
            ``generation_settings.json``), ``data_path``, ``recipe`` (training settings by
            name); None keeps the card's "How it was made" section as it is.
        location: where the draft will live, for the serve line (a checkpoint is written
            under a temporary name); default: ``draft_dir``.

    An existing card's acceptance section is kept: eval wrote it for these weights.
    """
    draft_dir = Path(draft_dir)
    config = read_json(draft_dir / "config.json")
    old = read_card(draft_dir)
    old_body = old[1] if old else ""
    facts = card_facts(config)
    target = facts["base_model"]
    name = Path(str(target)).name if target else "its target"
    lines = [
        f"# P-EAGLE draft for {name}",
        "",
        f"A parallel-drafting EAGLE-3 (P-EAGLE) draft: one forward pass proposes "
        f"{facts['speculative_tokens']} tokens that `{target}` verifies. Trained with "
        "speculators-peagle-plugin on the target's own replies.",
        "",
        "## Serve it",
        "",
        "```bash",
        serve_command(Path(location or draft_dir).resolve(), config),
        "```",
        "",
    ]
    made = _section(old_body, "## How it was made")
    if training is not None:
        rows = [("target", f"`{target}`"), *_made_rows(training)]
        made = "\n".join(["## How it was made", "", "| | |", "|---|---|",
                          *(f"| {k} | {v} |" for k, v in rows), ""])
    if made:
        lines += [made.rstrip("\n"), ""]
    evaluated = _between(old_body) or (
        f"Not evaluated yet: `speculators-peagle eval --target {target} --draft "
        f"{Path(location or draft_dir)}` writes its acceptance and speed here."
    )
    lines += ["## Acceptance and speed", "", EVAL_BEGIN, evaluated.strip("\n"), EVAL_END, ""]
    path = draft_dir / CARD_FILE
    atomic_write_text(path, _front_matter(config) + "\n" + "\n".join(lines))
    return path


def write_eval_section(draft_dir: str | Path, text: str) -> bool:
    """Replace the card's acceptance section with ``text``; False where there is no card."""
    card = read_card(draft_dir)
    if card is None or EVAL_BEGIN not in card[1]:
        return False
    path = Path(draft_dir) / CARD_FILE
    raw = path.read_text()
    head, rest = raw.split(EVAL_BEGIN, 1)
    tail = rest.split(EVAL_END, 1)[1] if EVAL_END in rest else ""
    atomic_write_text(path, f"{head}{EVAL_BEGIN}\n{text.strip()}\n{EVAL_END}{tail}")
    return True


def _between(body: str) -> str | None:
    if EVAL_BEGIN not in body or EVAL_END not in body:
        return None
    return body.split(EVAL_BEGIN, 1)[1].split(EVAL_END, 1)[0]


def _section(body: str, heading: str) -> str | None:
    """The markdown section under ``heading`` (up to the next ``## ``), or None."""
    if heading not in body:
        return None
    rest = body.split(heading, 1)[1]
    end = rest.find("\n## ")
    return heading + (rest if end < 0 else rest[: end + 1])


def card_findings(ckpt: DraftCheckpoint) -> list[Finding]:
    """A card whose facts differ from the checkpoint's config.json (one finding per fact)."""
    card = read_card(ckpt.path)
    if card is None:
        return []
    front, _ = card
    stated = {"base_model": front.get("base_model"), **front["peagle"]}
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
