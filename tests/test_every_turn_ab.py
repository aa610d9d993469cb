"""The every-turn A/B's prompt files (eval/every_turn_prompts.py): equal replies per arm,
from the same conversations, each conversation cut before a turn whose row may not fit.

Oracles: the row bound evaluated turn by turn, and the arms rebuilt from their definition.
"""

import json
import random
import sys

import pytest
from helpers.every_turn import sentence, turn, user

from eval import every_turn_prompts
from eval.every_turn_prompts import REPLY_TEMPLATE_TOKENS, equal_reply_arms, fitting_turns


@pytest.mark.parametrize("seed", range(5))
def test_fitting_turns_stop_at_the_first_row_that_may_not_fit(seed):
    assert fitting_turns([100, 250, 350], 100, 512) == 2  # the docstring's example
    rng = random.Random(seed)
    for _ in range(200):
        lengths = sorted(rng.randint(5, 600) for _ in range(rng.randint(0, 6)))
        new, row = rng.randint(1, 200), rng.randint(64, 1024)
        fits = [
            lengths[t] + (t + 1) * (new + REPLY_TEMPLATE_TOKENS) <= row for t in range(len(lengths))
        ]
        expected = fits.index(False) if False in fits else len(fits)
        assert fitting_turns(lengths, new, row) == expected


@pytest.mark.parametrize("seed", range(6))
def test_the_arms_have_equal_replies_from_the_same_conversations(seed):
    rng = random.Random(seed)
    conversations = [
        [user(f"c{c}t{t}") for t in range(rng.randint(1, 5))] for c in range(rng.randint(5, 40))
    ]
    fitting = [rng.randint(0, len(c)) for c in conversations]
    usable = [c[:k] for c, k in zip(conversations, fitting, strict=True) if k]
    for replies in range(1, len(usable) + 2):
        if replies > len(usable):
            with pytest.raises(SystemExit, match=f"--replies {replies} needs"):
                equal_reply_arms(conversations, fitting, replies)
            continue
        first, every = equal_reply_arms(conversations, fitting, replies)
        assert first == [c[:1] for c in usable[:replies]]
        assert sum(map(len, every)) == replies
        assert every[:-1] == usable[: len(every) - 1]  # whole, but for the last
        assert every[-1] == usable[len(every) - 1][: len(every[-1])]


def test_the_command_writes_both_files_from_sharegpt_turns(
    fake_sharegpt, target_dir, tmp_path, monkeypatch
):
    rng = random.Random(0)
    rows = []
    for _ in range(12):
        turns = []
        for _ in range(rng.randint(1, 4)):
            turns += [turn("human", sentence(rng, rng.randint(2, 40))), turn("gpt", "r")]
        rows.append({"conversations": turns})
    fake_sharegpt(rows)
    out = tmp_path / "ab"
    argv = [
        "every_turn_prompts",
        "--target",
        str(target_dir),
        "--replies",
        "6",
        "--max-new-tokens",
        "20",
        "--row-tokens",
        "200",
        "--out",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    every_turn_prompts.main()
    first, every = (
        [json.loads(line)["messages"] for line in (out / f"{arm}.jsonl").read_text().splitlines()]
        for arm in ("first", "every")
    )
    assert len(first) == 6 and all(len(c) == 1 for c in first)
    assert sum(map(len, every)) == 6 and len(every) < 6
    assert [c[0] for c in every] == [c[0] for c in first[: len(every)]]
    assert all(m["role"] == "user" for c in every for m in c)
