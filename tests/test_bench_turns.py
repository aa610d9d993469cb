"""eval.bench_turns' baseline arm: the turns of a job in lockstep, the same replies."""

import random

import pytest
from helpers.every_turn import user
from test_every_turn import FakeTarget, _random_conversation, _replayed, _user_turns

from eval.bench_turns import lockstep
from speculators_peagle_plugin.datagen.generation import _regenerate


class LockstepTarget(FakeTarget):
    generate = lockstep(FakeTarget.generate)


@pytest.mark.parametrize("seed", range(3))
def test_lockstep_asks_every_turn_t_before_any_turn_t_plus_1_and_replies_the_same(seed):
    rng = random.Random(seed)
    chats = [[m for m in _random_conversation(rng) if m["role"] != "assistant"]
             for _ in range(6)] + [[user(f"u{t}") for t in range(3)]]
    indices = list(range(len(chats)))
    done, target = {}, LockstepTarget(seed)
    _regenerate(target, chats, indices, seed, lambda k, r: done.setdefault(k, r))
    assert done == {k: _replayed(c, k, seed) for k, c in enumerate(chats)}
    turn_of = {}  # a prompt's turn: how many user turns it holds, less one
    for rows in done.values():
        for t, row in enumerate(rows):
            turn_of[tuple(row["input_ids"][: row["loss_mask"].index(1)])] = t
    asked = [turn_of[tuple(prompt)] for prompt in target.asked]
    assert asked == sorted(asked) and len(asked) == sum(map(_user_turns, chats))
    pipelined = FakeTarget(seed)
    _regenerate(pipelined, chats, indices, seed, lambda k, r: None)
    assert sorted(map(tuple, pipelined.asked)) == sorted(map(tuple, target.asked))
