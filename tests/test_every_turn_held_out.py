"""Every user turn of a conversation as a prompt, held out: the contamination guard checks
every turn, and the train/held-out split keeps a conversation's rows on one side.

Oracles: the guard's rule recomputed by brute force from its definition, row-pair checks of
the split (and the former per-row split for data with one row per prompt), and, end to end,
the conversation a generated row's text names.
"""

import json
import random
import re
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from datasets import load_from_disk
from helpers.chat_target import gen_args
from helpers.every_turn import sentence, turn, user
from transformers import AutoTokenizer

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data import open_training_data, split_samples
from speculators_peagle_plugin.data.contamination import HeldOutIndex
from speculators_peagle_plugin.data.layout import ROW_PROMPTS_FILE, DataError, mix_seed
from speculators_peagle_plugin.data.packing import SPLIT_STREAM
from speculators_peagle_plugin.data.prompts import load_prompt_set, read_training_prompts

# --- the contamination guard on every turn ----------------------------------------------------


def _words(text):
    return re.findall(r"[0-9a-z]+", text.lower())


def _copies(turns, held_out, n=8, share=0.5):
    """The oracle: the guard's rule from its definition, by brute force over every held-out
    prompt and every turn."""
    turn_words = [_words(t) for t in turns]
    runs = {tuple(w[i : i + n]) for w in turn_words for i in range(len(w) - n + 1)}
    for text in held_out:
        words = _words(text)
        mine = {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}
        if not mine:
            if words and any(w == words for w in turn_words):
                return True
        elif len(mine & runs) >= share * len(mine):
            return True
    return False


@pytest.mark.parametrize("seed", range(8))
def test_the_guard_checks_every_turn_like_the_brute_force_rule(seed):
    rng = random.Random(seed)
    held_out = [sentence(rng, rng.choice([3, 5, 9, 12, 20])) for _ in range(6)]
    index = HeldOutIndex(held_out)
    hits = {True: 0, False: 0}
    for _ in range(150):
        turns = [sentence(rng, rng.randint(1, 14)) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.4:  # a held-out prompt, whole or in part, in any turn
            k = rng.randrange(len(turns))
            words = rng.choice(held_out).split()
            part = words[rng.randint(0, len(words) // 2) :]
            turns[k] = f"{turns[k]} {' '.join(part).upper()}!"
        expected = _copies(turns, held_out)
        assert index.contaminated(turns) == expected, (turns, held_out)
        hits[expected] += 1
    assert hits[True] and hits[False]


def _mt_bench_question():
    return next(
        c[0]["content"]
        for c in load_prompt_set("mt_bench").conversations
        if len(c[0]["content"].split()) > 20
    )


def test_a_conversation_copying_a_held_out_prompt_in_a_later_turn_is_dropped(
    fake_sharegpt, tmp_path
):
    question = _mt_bench_question()
    clean = [turn("human", "hello there"), turn("gpt", "hi")]
    late = [*clean, turn("human", "thanks"), turn("gpt", "ok"), turn("human", question)]
    fake_sharegpt([{"conversations": clean}, {"conversations": late}])
    prompts, record = read_training_prompts("sharegpt_turns")
    assert prompts == [[user("hello there")]] and record["dropped"] == 1
    # the first-turns set never sees the later turn: both first turns stay
    assert read_training_prompts("sharegpt")[1]["dropped"] == 0
    # a prompts file: a held-out prompt in the third user turn drops the whole row
    rows = [
        {"messages": [user("a"), user("b"), user(f"Please: {question}")]},
        {"messages": [user("a"), user("b")]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, record = read_training_prompts(path)
    assert prompts == [[user("a"), user("b")]] and record["dropped"] == 1


# --- the split keeps a conversation's rows together ---------------------------------------------


def _data_with_prompts(tmp_path, prompts):
    (tmp_path / ROW_PROMPTS_FILE).write_text(json.dumps(prompts))
    return SimpleNamespace(num_samples=len(prompts), path=tmp_path)


def _ragged_prompts(rng):
    prompts, p = [], 0
    for _ in range(rng.randint(3, 30)):
        p += rng.randint(1, 3)  # prompt indices skip the guard's drops
        prompts += [p] * rng.choice([1, 1, 2, 3, 4, 7])
    return prompts


@pytest.mark.parametrize("seed", range(10))
def test_the_split_keeps_every_row_of_a_conversation_on_one_side(tmp_path, seed):
    rng = random.Random(seed)
    prompts = _ragged_prompts(rng)
    n = len(prompts)
    data = _data_with_prompts(tmp_path, prompts)
    for ratio in (0.5, 0.75, 0.9):
        keep = round(ratio * n)
        try:
            train, held = split_samples(data, ratio, seed)
        except DataError as err:  # allowed only when whole prompts leave a side empty
            assert "no held-out sample" in str(err) or "no training sample" in str(err)
            continue
        assert (train, held) == split_samples(data, ratio, seed)
        assert sorted(train + held) == list(range(n)) and list(train) == sorted(train)
        side = {i: i in set(train) for i in range(n)}
        for i in range(n):  # every pair of rows of one prompt: the same side
            for j in range(n):
                if prompts[i] == prompts[j]:
                    assert side[i] == side[j], (i, j)
        # train takes whole prompts until it holds keep rows: without its last one it has fewer
        assert len(train) >= keep > 0 and held
        sizes = {p: prompts.count(p) for p in {prompts[i] for i in train}}
        assert any(len(train) - size < keep for size in sizes.values())


@pytest.mark.parametrize("n", [7, 16, 100])
def test_one_row_per_prompt_splits_as_the_per_row_split_did(tmp_path, n):
    for with_file in (True, False):
        data = (
            _data_with_prompts(tmp_path, list(range(0, 2 * n, 2)))
            if with_file
            else SimpleNamespace(num_samples=n, path=tmp_path / "none")
        )
        for seed in range(5):
            generator = torch.Generator().manual_seed(mix_seed(seed, SPLIT_STREAM))
            order = torch.randperm(n, generator=generator).tolist()
            keep = round(0.75 * n)
            expected = (tuple(sorted(order[:keep])), tuple(sorted(order[keep:])))
            assert split_samples(data, 0.75, seed) == expected


def test_a_split_that_whole_prompts_cannot_make_is_onesentence(tmp_path):
    data = _data_with_prompts(tmp_path, [0] * 8 + [1] * 8)
    assert sorted(map(len, split_samples(data, 0.5, 0))) == [8, 8]
    with pytest.raises(DataError, match=r"16 samples in .* \(2 prompts\) leaves no held-out"):
        split_samples(data, 0.9, 0)
    (tmp_path / ROW_PROMPTS_FILE).write_text(json.dumps([0] * 5))
    with pytest.raises(DataError, match="does not name the prompt of each of the 16"):
        split_samples(data, 0.5, 0)


def test_generate_data_rows_of_a_conversation_split_together(target_dir, tmp_path):
    """End to end on the tiny chat target: a prompts file of several user turns a row gives
    one row per turn, each holding its conversation so far; the split keeps them together.
    Oracle: a row's conversation is the one whose unique first words its text holds."""
    rng = random.Random(0)
    rows, names = [], []
    for c in range(8):
        name = f"conv{c}x"
        turns = [user(f"{name} {sentence(rng, 3)}")]
        turns += [user(f"more {sentence(rng, 2)}") for _ in range(rng.randint(0, 2))]
        rows.append({"messages": turns})
        names.append(name)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "data"
    result = CliRunner().invoke(main, gen_args(target_dir, path, out, "--no-contamination-guard"))
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    texts = [tokenizer.decode(r["input_ids"]) for r in load_from_disk(str(out))]
    owner = [next(c for c, name in enumerate(names) if name in t) for t in texts]
    turns = [len(r["messages"]) for r in rows]
    assert owner == [c for c in range(8) for _ in range(turns[c])]  # one row per user turn
    for i, (text, c) in enumerate(zip(texts, owner, strict=True)):
        t = owner[:i].count(c)  # row i answers user turn t: it holds turns 0..t, in order
        at = [text.find(m["content"]) for m in rows[c]["messages"][: t + 1]]
        assert -1 not in at and at == sorted(at)
        assert all(m["content"] not in text for m in rows[c]["messages"][t + 1 :])
    data = open_training_data(out)
    for seed in range(4):
        train, held = split_samples(data, 0.6, seed)
        assert {owner[i] for i in train}.isdisjoint({owner[i] for i in held})
