"""A trained draft's model card: ``README.md`` beside its ``config.json``.

What a user reads before serving or sharing a draft: the target it drafts for, the data and
recipe that made it, what it accepts and how fast (the eval's table with its command), and
the exact ``vllm serve`` line. The card is a model hub card: YAML front matter, then
markdown. The front matter's ``peagle`` block states the config facts that matter when
serving (K, layers, draft vocabulary, aux layers, mask token), so ``check`` can tell a card
that no longer describes its checkpoint (:func:`~..serving.check_card.card_findings`).

Who writes what: ``train`` writes the card into every checkpoint it saves
(:func:`write_model_card`); ``eval`` merges what it measured into the card's ``peagle_eval``
entries and rewrites the acceptance section from them (:func:`write_eval_section`, with
:mod:`..evaluation.card`); ``export`` rewrites the facts of the copy it fixes. A README.md
without a ``peagle`` block is someone else's and is left alone.

A card is meant to be shared: it names the target by its model id (``base_model``, or none)
and local paths by :func:`portable_path`, never by an absolute path of this machine.

Example::

    write_model_card("ckpt/checkpoint-1000", training={"steps": 1000, ...})
    read_card("ckpt/checkpoint-1000")[0]["peagle"]["speculative_tokens"]   # its K
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from ..common.errors import UserError
from ..common.files import atomic_write_text
from ..common.reading import read_json
from .speculators_config import declared_k, object_at

__all__ = [
    "CARD_FILE",
    "card_facts",
    "check_base_model",
    "model_id",
    "portable_path",
    "raw_card",
    "read_card",
    "serve_command",
    "write_eval_section",
    "write_model_card",
]

CARD_FILE = "README.md"
EVAL_BEGIN, EVAL_END = "<!-- peagle-eval -->", "<!-- /peagle-eval -->"
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
EVALS = "peagle_eval"  # the front matter's list of eval entries (evaluation.card)
# A hub model id: ``name`` or ``owner/name``.
_MODEL_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def card_facts(config: dict) -> dict:
    """The facts of a draft's ``config.json`` that its card's ``peagle`` block states."""
    layer = config.get("transformer_layer_config") or {}
    return {
        "speculative_tokens": declared_k(config),
        "num_layers": layer.get("num_hidden_layers"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "aux_hidden_state_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
        "mask_token_id": config.get("mask_token_id"),
    }


def model_id(name) -> str | None:
    """``name`` if it is a hub model id (``owner/name``) rather than a local path, else None."""
    if not isinstance(name, str) or not _MODEL_ID.fullmatch(name) or name.startswith("."):
        return None
    return None if Path(name).exists() else name


def check_base_model(name: str | None) -> None:
    """Refuse a ``--base-model`` that is not a hub model id: a card names no local path."""
    if name is not None and model_id(name) is None:
        raise UserError(
            f"--base-model must be a hub model id such as owner/name (a model card names "
            f"no local path), got {name!r}."
        )


def portable_path(path: str | Path) -> str:
    """How a card names a local path: as given when relative, relative to the working
    directory when inside it, else by its last part (``/home/me/runs/d`` -> ``d``)."""
    path = Path(path)
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name


def _verifier(config: dict) -> str | None:
    return object_at(object_at(config, "speculators_config"), "verifier").get("name_or_path")


def _base_model(config: dict, given: str | None, old_front: dict) -> str | None:
    """The card's ``base_model``: ``given``, else the id an earlier card gave, else the
    verifier's name when it is an id, else the ``_name_or_path`` its local config names."""
    verifier = _verifier(config)
    named = None
    if verifier and (Path(verifier) / "config.json").is_file():
        named = read_json(Path(verifier) / "config.json").get("_name_or_path")
    for name in (given, old_front.get("base_model"), verifier, named):
        if model_id(name):
            return name
    return None


def serve_command(draft: str, config: dict, base_model: str | None = None) -> str:
    """The ``vllm serve`` line that serves ``draft`` with parallel drafting (the target:
    ``base_model``, else ``TARGET``)."""
    spec = {"method": "eagle3", "model": draft, "parallel_drafting": True,
            "num_speculative_tokens": declared_k(config)}
    return f"vllm serve {base_model or 'TARGET'} --speculative-config '{json.dumps(spec)}'"


def raw_card(draft_dir: str | Path) -> tuple[str, str] | None:
    """``(front matter text, body)`` of a README.md that opens with front matter."""
    path = Path(draft_dir) / CARD_FILE
    if not path.is_file():
        return None
    text = path.read_text()
    match = _FRONT.match(text)
    return None if match is None else (match.group(1), text[match.end() :])


def read_card(draft_dir: str | Path) -> tuple[dict, str] | None:
    """``(front matter, body)`` of the draft's card, or None where it has no card of ours."""
    raw = raw_card(draft_dir)
    if raw is None:
        return None
    try:
        front = yaml.safe_load(raw[0])
    except yaml.YAMLError:
        return None
    if not isinstance(front, dict) or not isinstance(front.get("peagle"), dict):
        return None
    return front, raw[1]


def _front_matter(config: dict, base_model: str | None, evals: list) -> str:
    front = {
        **({"base_model": base_model} if base_model else {}),
        "library_name": "vllm",
        "tags": ["speculative-decoding", "eagle3", "p-eagle", "speculators"],
        "peagle": card_facts(config),
        **({EVALS: evals} if evals else {}),
    }
    return "---\n" + yaml.safe_dump(front, sort_keys=False, width=1000) + "---\n"


def _made_rows(training: dict) -> list[tuple[str, str]]:
    rows = []
    data = training.get("data") or {}
    if data:
        guard = data.get("contamination") or {}
        d = data.get
        made = (
            (f"{training['samples']} samples: " if training.get("samples") else "")
            + f"the target's replies to `{portable_path(d('prompts') or '?')}` "
            f"({d('num_samples')} per prompt, temperature {d('temperature')}, up to "
            f"{d('max_new_tokens')} new tokens, {d('backend')} in {d('dtype')})"
        )
        rows.append(("data", made))
        if guard:
            held = ", ".join(guard.get("held_out", []))
            rows.append(("held out", f"{guard.get('dropped')} prompts dropped that overlap {held}"))
    elif training.get("data_path"):
        rows.append(("data", f"`{portable_path(training['data_path'])}`"))
    recipe = training.get("recipe") or {}
    settings = ", ".join(f"{k}={v}" for k, v in recipe.items() if v is not None)
    if settings:
        rows.append(("recipe", settings))
    if training.get("steps") is not None:
        rows.append(("trained", f"{training['steps']} optimizer steps"))
    return rows


def write_model_card(
    draft_dir: str | Path,
    training: dict | None = None,
    *,
    location: str | Path | None = None,
    base_model: str | None = None,
    evaluation: tuple[str, list[dict]] | None = None,
) -> Path:
    """Write (or rewrite) ``draft_dir/README.md`` from its ``config.json`` and ``training``.

    Args:
        draft_dir: a saved draft (its config.json is read).
        training: what made it, any of ``steps``, ``samples``, ``data`` (the data's
            ``generation_settings.json``), ``data_path``, ``recipe`` (the training settings
            the card states, by key, in order; None values left out); None keeps the
            card's "How it was made" section as it is.
        location: where the draft will live, for the serve line (a checkpoint is written
            under a temporary name); default: ``draft_dir``.
        base_model: the target's hub model id; default: see :func:`_base_model`.
        evaluation: ``(acceptance section text, eval entries)``; None keeps the card's own
            (eval wrote them for these weights).
    """
    draft_dir = Path(draft_dir)
    config = read_json(draft_dir / "config.json")
    old_front, old_body = read_card(draft_dir) or ({}, "")
    base_model = _base_model(config, base_model, old_front)
    target = base_model or Path(str(_verifier(config) or "its target")).name
    draft = portable_path(location or draft_dir)
    lines = [
        f"# P-EAGLE draft for {target}",
        "",
        f"A parallel-drafting EAGLE-3 (P-EAGLE) draft: one forward pass proposes "
        f"{declared_k(config)} tokens that `{target}` verifies. Trained with "
        "speculators-peagle-plugin on the target's own replies.",
        "",
        *_serve_section(draft, config, base_model, target),
    ]
    made = _section(old_body, "## How it was made")
    if training is not None:
        rows = [("target", f"`{target}`"), *_made_rows(training)]
        made = "\n".join(["## How it was made", "", "| | |", "|---|---|",
                          *(f"| {k} | {v} |" for k, v in rows), ""])
    if made:
        lines += [made.rstrip("\n"), ""]
    evaluated, evals = evaluation or (_between(old_body), old_front.get(EVALS) or [])
    evaluated = evaluated or (
        f"Not evaluated yet: `speculators-peagle eval --target TARGET --draft {draft}` "
        "(TARGET: the target's local directory) writes its acceptance and speed here."
    )
    lines += ["## Acceptance and speed", "", EVAL_BEGIN, evaluated.strip("\n"), EVAL_END, ""]
    path = draft_dir / CARD_FILE
    atomic_write_text(path, _front_matter(config, base_model, evals) + "\n" + "\n".join(lines))
    return path


def _serve_section(draft: str, config: dict, base_model: str | None, target: str) -> list[str]:
    where = f"`{draft}` is this draft's directory as seen from where it was written"
    if base_model is None:
        where += f"; `TARGET` is the target it drafts for, `{target}`"
    return ["## Serve it", "", where + ".", "", "```bash",
            serve_command(draft, config, base_model), "```", ""]


def write_eval_section(
    draft_dir: str | Path, text: str, evals: list[dict], base_model: str | None = None
) -> bool:
    """Rewrite the card with ``evals`` as its eval entries and ``text`` as its acceptance
    section (and ``base_model``, when given); False where there is no card of ours."""
    if read_card(draft_dir) is None:
        return False
    write_model_card(draft_dir, base_model=base_model, evaluation=(text, evals))
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
