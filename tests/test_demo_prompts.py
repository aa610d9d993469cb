"""The demo's prompt stages: validation prompts that are also training prompts (a chat set
repeats first turns; ``sharegpt_turns`` holds ``sharegpt``'s) are left out, counted and said;
the oracles are the sets themselves and every prompt of every conversation, by brute force."""

import json
import random
from pathlib import Path

import pytest
from helpers.every_turn import sentence, turn

from speculators_peagle_plugin.data.prompts import load_prompt_set
from speculators_peagle_plugin.demo.artifacts import RunLayout
from speculators_peagle_plugin.demo.demo_config import DemoConfig
from speculators_peagle_plugin.demo.pipeline import _prompts_stage
from speculators_peagle_plugin.demo.stages import Stages

RECIPE = Path(__file__).parents[1] / "configs" / "recipes" / "long_smollm2.yaml"


def rows(path):
    return [json.loads(line)["messages"] for line in path.read_text().split("\n") if line]


def both_stages(tmp_path, train, validation):
    """The demo's training then validation prompt stages of ``train`` and ``validation``
    (specs); ``(config, layout, said, the validation stage's outputs)``."""
    config = DemoConfig.from_recipe(
        RECIPE, run_dir=str(tmp_path), train_prompts=(train,),
        validation_prompts=(validation,), max_prompt_tokens=None,
    )
    layout, said = RunLayout(tmp_path), []
    stages = Stages(tmp_path, said.append)
    _prompts_stage(config, stages, layout.prompts, tmp_path)
    out = _prompts_stage(config, stages, layout.validation_prompts, tmp_path,
                         "validation prompts", config.validation_prompts, layout.prompts)
    return config, layout, said, out


def test_validation_prompts_that_are_training_prompts_are_left_out(tmp_path):
    config, layout, said, out = both_stages(tmp_path, "humaneval[0:3]+chat[0:3]", "chat[1:5]")
    chat = load_prompt_set("chat[0:5]").conversations
    assert rows(layout.validation_prompts) == chat[3:5]  # chat[1:3] are training prompts
    assert out["count"] == 2 and out["left_out"] == 2
    assert (f"[validation prompts] 2 conversations -> {layout.validation_prompts} (2 left out: "
            "training prompts too)") in said
    # a run directory whose validation prompts were written before they left training's out
    record = json.loads((tmp_path / "stages.json").read_text())
    del record["validation prompts"]["inputs"]["training_left_out"]
    (tmp_path / "stages.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="made with other settings \\(training_left_out\\)"):
        _prompts_stage(config, Stages(tmp_path, said.append), layout.validation_prompts,
                       tmp_path, "validation prompts", config.validation_prompts, layout.prompts)


def prompts_of(conversation):
    """Every prompt generation answers in ``conversation``: each user turn with the system and
    user turns before it (the replies are written anew)."""
    asked = [m for m in conversation if m["role"] in ("system", "user")]
    return {json.dumps(asked[: i + 1]) for i, m in enumerate(asked) if m["role"] == "user"}


@pytest.mark.parametrize("seed", range(4))
def test_a_validation_conversation_that_opens_as_a_training_one_is_left_out(
    tmp_path, fake_sharegpt, seed
):
    rng = random.Random(seed)
    openings = [sentence(rng, 4) for _ in range(4)]  # few: conversations share them
    fake_sharegpt([
        {"conversations": [turn(("human", "gpt")[i % 2],
                                rng.choice(openings) if i == 0 else sentence(rng, 5))
                           for i in range(rng.randint(1, 6))]}
        for _ in range(16)
    ])
    _, layout, _, out = both_stages(tmp_path, "sharegpt_turns[0:6]", "sharegpt_turns[6:]+sharegpt")
    trained = set().union(*map(prompts_of, rows(layout.prompts)))
    candidates = load_prompt_set("sharegpt_turns[6:]+sharegpt").conversations
    held = [c for c in candidates if not prompts_of(c) & trained]
    assert rows(layout.validation_prompts) == held
    assert out["left_out"] == len(candidates) - len(held) > 0


WORDS = "hello world , how are you ? the quick brown fox".split()


def worst_case_prompts(tokenizer, conversation, max_new_tokens):
    """Oracle: each user turn's prompt as generation builds it, every earlier reply
    ``max_new_tokens`` tokens long ("Z" repeated: one token each in the tiny tokenizer)."""
    reply = "Z" * max_new_tokens
    assert len(tokenizer.encode(reply)) == max_new_tokens
    history, lengths = [], []
    for m in conversation:
        if m["role"] == "user":
            history.append(m)
            lengths.append(len(tokenizer.apply_chat_template(
                history, add_generation_prompt=True, tokenize=True, return_dict=False)))
            history.append({"role": "assistant", "content": reply})
        elif m["role"] == "system":
            history.append(m)
    return lengths


@pytest.mark.parametrize("seed", range(6))
def test_the_length_cap_cuts_a_conversation_before_its_first_turn_that_may_not_fit(
    target_dir, seed
):
    from transformers import AutoTokenizer

    from speculators_peagle_plugin.demo.artifacts import prompt_length_cut

    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    cap, new = rng.randint(30, 120), rng.randint(2, 12)
    fit = prompt_length_cut(cap, target_dir, new)
    cut_inside = 0
    for _ in range(40):
        conversation = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
        for t in range(rng.randint(1, 4)):
            if t:
                conversation.append({"role": "assistant", "content": "recorded , ignored"})
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            conversation.append({"role": "user", "content": words})
        lengths = worst_case_prompts(tokenizer, conversation, new)
        fitting = next((t for t, n in enumerate(lengths) if n > cap), len(lengths))
        users = [i for i, m in enumerate(conversation) if m["role"] == "user"]
        expected = conversation[: users[fitting - 1] + 1] if fitting else None
        assert fit(conversation) == expected
        cut_inside += 0 < fitting < len(users)
    assert cut_inside  # the case the cap's multi-turn rule is about
