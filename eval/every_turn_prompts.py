"""The every-turn A/B's prompts: first turns only against every user turn, equal replies.

Usage (the whole A/B, data to served figures: ``eval/every_turn_ab.sh``)::

    .venv/bin/python -m eval.every_turn_prompts --target T --replies 2000 \
        --max-new-tokens 128 --row-tokens 1024 --out runs/every-turn

Both arms come from the same ShareGPT conversations, in the file's order
(``sharegpt_turns`` after the contamination guard). ``OUT/first.jsonl`` holds the first
user turn of each of the first ``replies`` conversations; ``OUT/every.jsonl`` every user
turn of as many of the same conversations as make ``replies`` user turns (the last one cut
after the turn that completes the count). Each file gets one reply per user turn from
``generate-data --num-samples 1``, so both arms train on ``replies`` rows.

A conversation is cut before its first user turn whose row may not fit ``row_tokens``
(training's ``total_seq_len``): its prompt rendered with the turns before it, plus
``max_new_tokens`` and the chat template's few tokens per reply so far
(:func:`~speculators_peagle_plugin.data.storage.token_bound`'s bound). A longer row would
be cut to its prompt in training. A conversation whose first turn does not fit is left out
of both arms.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from speculators_peagle_plugin.common.files import atomic_write_text

REPLY_TEMPLATE_TOKENS = 8  # a reply's role header and end marker, with margin


def fitting_turns(lengths: list[int], max_new_tokens: int, row_tokens: int) -> int:
    """How many user turns of a conversation fit, counted up to the first that may not.

    ``lengths[t]``: the rendered length of its user turns up to turn t. Turn t's row holds
    that, the t replies before it and its own: at most ``lengths[t] + (t + 1) * (max_new_tokens
    + REPLY_TEMPLATE_TOKENS)`` tokens. Example: lengths [100, 250, 350], 100 new tokens,
    512-token rows -> 2 (turn 2 may need 350 + 3 * 108 = 674).
    """
    for t, length in enumerate(lengths):
        if length + (t + 1) * (max_new_tokens + REPLY_TEMPLATE_TOKENS) > row_tokens:
            return t
    return len(lengths)


def equal_reply_arms(
    conversations: list[list[dict]], fitting: list[int], replies: int
) -> tuple[list[list[dict]], list[list[dict]]]:
    """``(first, every)``: ``replies`` first turns, and ``replies`` user turns of whole
    conversations, from the same conversations in order; ``fitting[c]`` of conversation
    c's user turns fit (0: left out of both).

    Example: user turns [a1 a2 a3], [b1], [c1 c2], all fitting, 3 replies -> first [[a1],
    [b1], [c1]], every [[a1, a2, a3]].

    Raises ``SystemExit`` when the conversations hold fewer than ``replies`` of either.
    """
    first, every, turns = [], [], 0
    for conversation, k in zip(conversations, fitting, strict=True):
        users = [m for m in conversation if m["role"] == "user"][:k]
        if not users:
            continue
        if len(first) < replies:
            first.append(users[:1])
        if turns < replies:
            every.append(users[: replies - turns])
            turns += len(every[-1])
        if len(first) == replies:
            return first, every
    raise SystemExit(
        f"the conversations give {len(first)} first turns and {turns} user turns that fit; "
        f"--replies {replies} needs that many of each (lower it, or raise --row-tokens)."
    )


def _write(path: Path, conversations: list[list[dict]]) -> None:
    rows = "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations)
    atomic_write_text(path, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="The target (its chat template).")
    parser.add_argument("--replies", type=int, required=True, help="Rows of each arm.")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--row-tokens", type=int, required=True, help="total_seq_len.")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from speculators_peagle_plugin.data.prompts import read_training_prompts
    from speculators_peagle_plugin.data.storage import prompt_lengths

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    conversations = read_training_prompts("sharegpt_turns")[0]
    # the first ``replies`` conversations with a fitting first turn are all either arm reads
    fitting, useful = [], 0
    for conversation in conversations:
        if useful == args.replies:
            break
        (lengths,) = prompt_lengths(tokenizer, [conversation])
        fitting.append(fitting_turns(lengths, args.max_new_tokens, args.row_tokens))
        useful += fitting[-1] > 0
    first, every = equal_reply_arms(conversations[: len(fitting)], fitting, args.replies)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "first.jsonl", first)
    _write(out / "every.jsonl", every)
    print(
        f"{len(first)} first turns -> {out / 'first.jsonl'}; {args.replies} user turns of "
        f"{len(every)} conversations -> {out / 'every.jsonl'}"
    )


if __name__ == "__main__":
    main()
